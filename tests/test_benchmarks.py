"""The benchmarks run on tiny configs, and BENCHMARKS.md is the suite's output."""

import ctypes
import gzip
import importlib
import inspect
import itertools
import json
import math
import os
import pathlib
import re
import statistics
import sys
import time

import _fake_smi
import pytest

# The benchmark scripts import as modules, as they do beside each other.
sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
)

import autocast as autocast_bench
import compile_time
import device_time
import fp8
import gpt2
import gpt2_memory
import gpt_compare
import gpt_model
import gpu_clock
import lean_state
import loss_head
import md
import memory_table
import overhead
import ptx_loads
import rounding_memory
import suite
import timing
import zero1

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def saved_results():
  results = {p.stem: json.loads(p.read_text()) for p in RESULTS.glob("*.json")}
  env = results.pop("environment")
  return results, env, results.pop("environment-gpu", None)


def test_benchmarks_md_is_the_suite_rendering_of_the_saved_results(tmp_path):
  out = tmp_path / "BENCHMARKS.md"
  results = suite.main(
    ["--render", "--json-dir", str(RESULTS), "--out", str(out)]
  )
  assert out.read_text() == (ROOT / "BENCHMARKS.md").read_text()
  # Every saved result belongs to a job, and every marker was filled in.
  assert all(suite.script_of(name) for name in results)
  page = out.read_text()
  assert "<!-- table:" not in page and "<!-- machines -->" not in page
  for heading in ("Step-time overhead", "Compile time", "ZeRO-1", "FP8"):
    assert f"## {heading}" in page
  assert "## GPT-2 small" in page


def test_every_marker_names_a_table_of_its_script():
  markers = suite.TABLE.findall(suite.PAGE.read_text())
  assert len(markers) >= 10
  scripts = {suite.script_of(n) for n in suite.CPU_JOBS | suite.GPU_JOBS}
  for module, function in markers:
    assert module in scripts, module
    assert callable(getattr(importlib.import_module(module), function))


def test_every_gpu_job_line_is_accepted_by_its_script(capsys):
  # A lent GPU runs the GPU jobs once; a typo in a line, a preset name or a
  # choice must fail here, not after minutes of that run.
  gpu_tables = (suite.GPU_JOBS, suite.GPU_QUICK)
  for table in (*gpu_tables, suite.CPU_JOBS, suite.CPU_QUICK):
    for name, (path, *argv) in suite.jobs_of(table).items():
      module = importlib.import_module(pathlib.Path(path).stem)
      if any(table is t for t in gpu_tables):
        assert hasattr(module, "parse_args"), (name, path)
      if hasattr(module, "parse_args"):
        module.parse_args(argv)  # exits (fails the test) on a bad line
  # The checks themselves refuse what they should.
  for parse, argv, message in (
    (gpt2.parse_args, ["--presets", "bf16-mixd"], "--presets: Unknown preset"),
    (gpt2.parse_args, ["--autocast", "fp17"], "--autocast: Unknown preset"),
    (gpt2.parse_args, ["--torch-precisions", "bf16,f16"], "'f16'; accepted"),
    (gpt2.parse_args, ["--presets", "bf16-mixed,"], "names an empty preset"),
    (gpt2.parse_args, ["--kernels", "--profile", "d"], "drop --kernels"),
    (gpt2.parse_args, ["--loss", "fused", "--lse", "two-pass"], "logits loss"),
    (
      gpt2.parse_args,
      ["--torch", "--gelu", "logistic"],
      "--gelu logistic: --lse, --lse-slices, --gelu and --qkv change the",
    ),
    (
      gpt2.parse_args,
      ["--torch", "--lse-slices", "24"],
      "--lse-slices 24: --lse, --lse-slices, --gelu and --qkv change the",
    ),
    # --lse-slices: gpt_model.checked_slices's rule and words, at parse time.
    (
      gpt2.parse_args,
      ["--lse-slices", "0"],
      "--lse-slices: slices must be a positive Python int that divides the"
      " rows' length 50304 (its divisors up to 128: 1, 2, 3, 4, 6, 8, 12,"
      " 16, 24, 32, 48, 64, 96, 128); got 0",
    ),
    (
      gpt2.parse_args,
      ["--lse-slices", "25"],
      "128: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128); got 25",
    ),
    (
      gpt2.parse_args,
      ["--tiny", "--lse-slices", "3"],
      "length 128 (its divisors up to 128: 1, 2, 4, 8, 16, 32, 64, 128); got 3",
    ),
    (
      gpt2.parse_args,
      ["--lse", "two-pass", "--lse-slices", "24"],
      "it needs --loss logits and --lse one-pass",
    ),
    (
      gpt2.parse_args,
      ["--loss", "fused", "--lse-slices", "24"],
      "it needs --loss logits and --lse one-pass",
    ),
    (gpt2.parse_args, ["--gelu", "erf"], "invalid choice: 'erf'"),
    (gpt2.parse_args, ["--torch", "--qkv", "dense"], "--qkv dense: --lse"),
    (gpt2.parse_args, ["--qkv", "fused"], "invalid choice: 'fused'"),
    (gpt2_memory.parse_args, ["--preset", "bf16-lin"], "choice: 'bf16-lin'"),
    (gpt2_memory.parse_args, ["--target", "a100"], "invalid choice: 'a100'"),
    (loss_head.parse_args, ["--chunks", "64,0"], "'64,0' is not a comma"),
    (loss_head.parse_args, ["--chunks", "64,x"], "'64,x' is not a comma"),
    (
      loss_head.parse_args,
      ["--lse-slices", "24,5"],
      "--lse-slices: slices must be a positive Python int that divides the"
      " rows' length 50304 (its divisors up to 128: 1, 2, 3, 4, 6, 8, 12,"
      " 16, 24, 32, 48, 64, 96, 128); got 5",
    ),
    (loss_head.parse_args, ["--lse-slices", "0"], "'0' is not a comma"),
  ):
    with pytest.raises(SystemExit):
      parse(argv)
    assert message in capsys.readouterr().err


def test_every_gpu_job_xla_flag_is_one_xla_knows():
  # A misspelled XLA flag aborts the backend's start on the GPU; XLA parses
  # its GPU options on CPU too, so the same start here finds the typo.
  import os
  import subprocess

  flags = {
    gpt2.parse_args(argv).xla_flags
    for path, *argv in suite.jobs_of(suite.GPU_JOBS).values()
    if path.endswith("/gpt2.py")
  } - {""}
  assert len(flags) >= 3, flags  # cuDNN LayerNorm, no Triton GEMMs, both

  def starts(xla_flags):
    env = dict(os.environ, XLA_FLAGS=xla_flags, JAX_PLATFORMS="cpu")
    run = subprocess.run(
      [sys.executable, "-c", "import jax; jax.devices()"],
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
    )
    return run.returncode == 0, run.stderr

  # All of them in one start: XLA names every flag it does not know.
  ok, err = starts(" ".join(sorted(flags)))
  assert ok, (flags, err[-500:])
  ok, err = starts("--xla_gpu_enable_cudnn_layer_nrm=true")  # the check bites
  assert not ok and "Unknown flag" in err


def test_tables_without_results_say_not_measured():
  for module, function in suite.TABLE.findall(suite.PAGE.read_text()):
    text = getattr(importlib.import_module(module), function)({})
    assert text.startswith("Not measured"), (module, function)


def test_gpu_results_render_beside_cpu_ones():
  results, env, gpu_env = saved_results()
  gpu_jobs = set(suite.jobs(False, True))
  assert gpu_jobs.isdisjoint(suite.jobs(False, False))
  cpu_only = {k: v for k, v in results.items() if k not in gpu_jobs}
  without = suite.render(cpu_only, env, None, False)
  assert "GPU machine: none lent" in without
  for table in (gpt2.table, fp8.matmul_table, overhead.gpu_table):
    assert table({}) in without
  saved_gpu = gpu_jobs & set(results)
  if not {"gpt2", "overhead-gpu", "fp8-matmul"} <= saved_gpu:
    pytest.skip("no GPU results saved in benchmarks/results")
  page = suite.render(results, env, gpu_env, False)
  assert "GPU machine: " + gpu_env["gpu"] in page
  # The verdict is the fastest saved bf16-mixed row's, whichever gpt2.py run
  # (not its PyTorch twin's) has it.
  mixed = max(
    (
      x
      for name, r in results.items()
      if suite.script_of(name) == "gpt2" and "framework" not in r
      for x in r.get("rows", [])
      if x["step"] == "bf16-mixed"
    ),
    key=lambda x: x["tokens_per_s"],
  )
  assert f"Goal (bf16-mixed >= 45% MFU): {100 * mixed['mfu']:.1f}%" in page


def verdict(text, goal):
  """The verdict of the sentence that states `goal` in a table's text."""
  (sentence,) = [s for s in text.split("\n") if goal in s]
  return re.search(r"\*\*(met|not met)\*\*", sentence)[1]


def test_verdicts_are_computed_from_the_numbers():
  compile_row = {
    "step": "ours-fp16",
    "trace_lower_s": 1.0,
    "compile_s": 1.0,
    "total_s": 2.0,
    "ratio_vs_plain": 1.5,
  }
  for hand, want in ((1.19, "met"), (1.21, "not met")):
    result = {
      "model": "GPT",
      "rounds": 1,
      "depths": 2,
      "device": "cpu",
      "rows": [dict(compile_row, ratio_vs_hand=hand)],
    }
    assert verdict(compile_time.table({"c": result}), "Goal") == want
  for mfu, want in ((0.46, "met"), (0.44, "not met")):
    row = dict(step="bf16-mixed", ms=1.0, steps_per_s=1.0, tokens_per_s=1)
    row.update(tflops=1.0, mfu=mfu, ratio_vs_plain=1.0)
    result = {
      "model": "GPT",
      "device": "H100",
      "peak_bf16_tflops": 989.4,
      "batch": 16,
      "steps_per_round": 30,
      "rows": [row],
    }
    text = gpt2.table({"gpt2": result})
    assert verdict(text, "45% MFU") == want
    assert f"MFU): {100 * mfu:.1f}% at 30 steps per wait, **" in text
    assert "| bf16-mixed | 16 | 30 | logits |" in text
  # The verdict's run is the fastest, and it names that run's steps per wait.
  slow = dict(result, steps_per_round=5, batch=8)  # listed first
  slow["rows"] = [dict(row, tokens_per_s=0, mfu=0.3)]
  text = gpt2.table({"a": slow, "b": result})
  assert "MFU): 44.0% at 30 steps per wait, **not met**" in text
  # FP8: digits within 1 point of no FP8, the GPT's mean over seeds within
  # 0.02 of it (here seed 1's difference is 0.01).
  for acc, loss, want in (
    (0.975, 2.029, "met"),
    (0.965, 2.029, "not met"),
    (0.975, 2.031, "not met"),
  ):
    digits_rows = [
      {"model": "mlp", "preset": "bf16-mixed", "accuracy": {"off": 0.98}},
      {"model": "cnn", "preset": "bf16-mixed", "accuracy": {"off": 0.99}},
    ]
    digits_rows[0]["accuracy"]["blockwise"] = acc
    digits_rows[1]["accuracy"]["blockwise"] = 0.99
    config = dict(steps=4, layers=1, d_model=8, batch_size=2, seq_len=4)
    runs = [
      dict(fp8=recipe, seed=seed, final_val_loss=val, skipped_steps=0)
      for recipe, seed, val in (
        ("off", 0, 2.0),
        ("blockwise", 0, loss),
        ("off", 1, 3.0),
        ("blockwise", 1, 3.01),
      )
    ]
    result = {
      "accuracy": {"epochs": 1, "seed": 0, "rows": digits_rows},
      "gpt": {"preset": "bf16-mixed", "config": config, "runs": runs},
    }
    text = fp8.accuracy_table({"fp8": result})
    # The GPT table's row, then the per-recipe verdict's.
    _, row = [r for r in text.split("\n") if r.startswith("| blockwise | ")]
    assert re.search(r"\*\*(met|not met)\*\*", row)[1] == want
  for speedup, want in ((1.31, "met"), (1.29, "not met")):
    rows = [
      {"n": n, "flops": 6 * n**3, "ms": {"bf16": 1.0, "current": 1 / speedup}}
      | {"speedup_over_bf16": {"current": speedup}}
      for n in (8, 16)
    ]
    result = {"device": "H100", "rounds": 2, "matmul": rows}
    text = fp8.matmul_table({"fp8-matmul": result})
    assert verdict(text, "at the largest size, n = 16") == want
  results, _, _ = saved_results()
  z = results["zero1"]
  assert verdict(zero1.bytes_table({"zero1": z}), "Goal") == "met"
  worse = dict(
    z,
    memory=[
      dict(m, total_bytes_per_param=1.02 * m["formula_total"])
      for m in z["memory"]
    ],
  )
  assert verdict(zero1.bytes_table({"zero1": worse}), "Goal") == "not met"


def test_overhead_benchmark_runs_and_renders(capsys):
  result = overhead.main(
    ["--dims", "16,32,4", "--batch", "8", "--steps", "3", "--warmup", "1"]
  )
  assert set(result["ratio_vs_plain"]) == {
    "plain",
    "skip-only",
    "ours",
    "jmp-style",
  }
  assert result["skipped_steps_ours"] == 0
  assert "| ours |" in capsys.readouterr().out
  masters = overhead.main(
    ["--dims", "16,32,4", "--steps", "2", "--warmup", "1"]
    + ["--update-only", "--bf16-params"]
  )
  assert set(masters["ratio_vs_hand-masters"]) == {"hand-masters", "ours"}
  assert masters["param_dtype"] == "bfloat16"
  results = {"overhead-64": result, "overhead-masters-update": masters}
  assert "| full step, batch 8 |" in overhead.table(results)
  assert "| optimizer update only | CPU |" in overhead.masters_table(results)


def test_fp8_matmul_benchmark_runs_every_recipe(capsys):
  result = fp8.main(
    ["--matmul", "--sizes", "32", "--rounds", "2", "--warmup", "1"]
  )
  (row,) = result["matmul"]
  assert row["n"] == 32 and list(row["ms"]) == ["bf16", *fp8.RECIPES]
  assert all(t > 0 for t in row["ms"].values())
  assert list(row["speedup_over_bf16"]) == list(fp8.RECIPES)
  out = capsys.readouterr().out
  for name in fp8.RECIPES:
    assert f"| 32 | {name} |" in out
  assert "n = 32: delayed " in fp8.matmul_table({"fp8-matmul": result})
  assert "stopped" not in fp8.matmul_table({"fp8-matmul": result})


def test_fp8_matmul_benchmark_keeps_the_sizes_done_when_stopped(
  tmp_path, monkeypatch
):
  # A GPU job past its time limit is killed: the JSON then holds the sizes
  # it finished (here the second size's steps fail to build instead).
  build = fp8.dense_steps

  def dense_steps(n, recipes):
    if n == 48:
      raise KeyboardInterrupt("stopped")
    return build(n, recipes)

  monkeypatch.setattr(fp8, "dense_steps", dense_steps)
  path = tmp_path / "fp8-matmul.json"
  argv = ["--matmul", "--sizes", "32,48", "--recipes", "current"]
  with pytest.raises(KeyboardInterrupt):
    fp8.main([*argv, "--rounds", "1", "--warmup", "1", "--json", str(path)])
  saved = json.loads(path.read_text())
  assert saved["sizes"] == [32, 48]
  assert [x["n"] for x in saved["matmul"]] == [32]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8-matmul.json"]
  table = fp8.matmul_table({"fp8-matmul": saved})
  assert "not judged, the run stopped before n = 48" in table
  assert "(at n = 32: current " in table and "met**" not in table


def test_fp8_gather_sends_one_byte_per_fp8_kernel_weight():
  # The example's GPT at a tiny size (every dimension divides 8: nothing
  # padded), lowered only.
  cfg = fp8.gpt.parse_args(
    [*("--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8")]
    + ["--batch-size", "8"]
  )
  result = fp8.gather_bytes(cfg, compiled=False)
  # Every Dense but the head runs in FP8 and stores its kernel in FP8.
  layers = ["attn/qkv", "attn/proj", "fc", "out"]
  assert sorted(result["fp8_params"]) == sorted(
    f"block0/{name}/kernel" for name in layers
  )
  weights = sum(result["fp8_params"].values())
  bf16, ours = result["rows"]
  # The written rule: an all-gather of S bytes over 8 devices sends 7S/8;
  # a kernel weight is 2 bytes in bf16, 1 in FP8; the rest is unchanged.
  assert bf16["kernel_ops"] == ours["kernel_ops"] == len(layers)
  assert bf16["kernel_elements"] == ["bf16"]
  assert ours["kernel_elements"] == ["ui8"]
  assert bf16["kernel_bytes"] == 2 * weights * 7 / 8
  assert ours["kernel_bytes"] == weights * 7 / 8
  assert ours["other_bytes"] == bf16["other_bytes"] > 0
  # Params per device: each FP8 kernel is 1 byte a weight and an int32.
  saved = bf16["memory"]["params"] - ours["memory"]["params"]
  assert saved == weights - 4 * len(layers)
  text = fp8.gather_table({"fp8-gather": {"gather": result}})
  assert verdict(text, "at most half") == "met"
  assert "| bf16 | 4 (bf16) |" in text and "not compiled" in text
  worse = dict(ours, kernel_bytes=0.51 * bf16["kernel_bytes"])
  text = fp8.gather_table({"g": {"gather": dict(result, rows=[bf16, worse])}})
  assert verdict(text, "at most half") == "not met"


def test_fp8_gpt_adds_fp8_params_rows_and_reuses_recorded_runs(
  tmp_path, monkeypatch
):
  calls = []

  def fake_main(argv):  # the example's own runs are tested elsewhere
    calls.append(argv)
    loss = 2.0 + 0.001 * len(calls)
    return [dict(final_val_loss=loss, skipped_steps=0, seconds=1.0)]

  monkeypatch.setattr(fp8.gpt, "main", fake_main)
  flags = ["--gpt", "--recipes", "current", "--seeds", "0,1", "--steps", "4"]
  saved = tmp_path / "gpt.json"
  fp8.main([*flags, "--params-recipes", "", "--json", str(saved)])
  assert len(calls) == 4
  calls.clear()
  result = fp8.main([*flags, "--reuse", str(saved)])["gpt"]
  # Only the new row trained, with --fp8-params; the rest came from JSON.
  assert [c[2:6] for c in calls] == [
    ["--fp8", "current", "--fp8-params", "--seed"]
  ] * 2
  old = json.loads(saved.read_text())["gpt"]
  names = ["off", "current", "current+params"]
  assert [(x["fp8"], x["seed"]) for x in result["runs"]] == [
    (name, seed) for seed in (0, 1) for name in names
  ]
  assert [x for x in result["runs"] if x["fp8"] != "current+params"] == (
    old["runs"]
  )
  assert result["reused"] == [[x["fp8"], x["seed"]] for x in old["runs"]]
  text = fp8.accuracy_table({"fp8-gpt": {"gpt": result}})
  assert "| current+params | " in text and "add `--fp8-params`" in text
  assert "4 of these 6 runs (off, current) were recorded" in text
  with pytest.raises(SystemExit, match="--reuse .* reuse only runs of"):
    fp8.main([*flags[:-1], "5", "--reuse", str(saved)])
  with pytest.raises(SystemExit):  # blockwise has no FP8 params
    fp8.parse_args(["--gpt", "--params-recipes", "blockwise"])


def test_compile_time_benchmark_runs_and_renders(tmp_path):
  result = compile_time.main(
    [
      *("--layers", "1", "--d-model", "16", "--heads", "2", "--seq", "8"),
      *("--batch", "2", "--rounds", "1", "--json", str(tmp_path / "c.json")),
      *("--only", "plain,hand-fp16,ours-fp16", "--depths", "2"),
    ]
  )
  names = [r["step"] for r in result["rows"]]
  assert names == ["plain", "hand-fp16", "ours-fp16"]
  for row in result["rows"]:
    assert row["compile_s"] > 0 and row["trace_lower_s"] > 0
    assert (row["ratio_vs_hand"] is None) == (
      not row["step"].startswith("ours")
    )
  saved = json.loads((tmp_path / "c.json").read_text())
  section = compile_time.table({"compile": saved})
  assert "| ours-fp16 |" in section and "Goal: at most 1.2x" in section
  for row in saved["rows"]:  # the table's trace time: the median over depths
    by_depth = row["trace_lower_by_depth_s"]
    assert len(by_depth) == 2
    assert row["trace_lower_s"] == pytest.approx(sum(by_depth) / 2, abs=1e-3)
  depths = compile_time.depth_table({"compile": saved})
  ours, hand = (saved["rows"][i]["trace_lower_by_depth_s"] for i in (2, 1))
  low, high = sorted(o / h for o, h in zip(ours, hand, strict=True))
  assert f"| ours-fp16 | {min(ours):.3f} |" in depths
  assert f"{low:.3f}x to {high:.3f}x |" in depths


@pytest.mark.skipif(
  sys.implementation.name != "cpython", reason="CPython's frame stack"
)
def test_padding_frames_take_their_slots_of_the_frame_stack():
  """Each padding frame moves the next frame PAD_SLOTS slots further along
  CPython's frame stack, and about DEPTHS of them fill a chunk: read from the
  frames' own addresses."""
  word = ctypes.sizeof(ctypes.c_void_p)

  def frame_address():  # PyFrameObject: the object header, f_back, f_frame
    address = id(sys._getframe()) + object.__basicsize__ + word
    return ctypes.c_void_p.from_address(address).value

  addresses = [timing._pad(n, frame_address) for n in range(4 * timing.DEPTHS)]
  steps = [(b - a) // word for a, b in itertools.pairwise(addresses)]
  # Within a chunk each frame sits PAD_SLOTS past the one before (a frame's
  # header may differ by a slot or two between CPython versions).
  assert abs(statistics.median(steps) - timing.PAD_SLOTS) <= 2
  # Where a chunk is full the next frame starts in a new one, far away: the
  # chunks hold about DEPTHS padding frames each (less their own header).
  ends = [i for i, step in enumerate(steps) if step != statistics.median(steps)]
  assert len(ends) >= 3
  assert {b - a for a, b in itertools.pairwise(ends)} <= {
    timing.DEPTHS - 1,
    timing.DEPTHS,
  }


def test_seconds_by_depth_calls_each_name_from_each_depth():
  depths = []
  seconds = timing.seconds_by_depth(
    ["a", "b"], lambda name: depths.append((name, len(inspect.stack(0)))), 4
  )
  assert {k: len(v) for k, v in seconds.items()} == {"a": 4, "b": 4}
  assert [n for n, _ in depths] == ["a", "b", "b", "a", "a", "b", "b", "a"]
  a = [d for n, d in depths if n == "a"]
  assert a == [d for n, d in depths if n == "b"]  # the same depths for both
  # Evenly spread over one chunk's padding frames: 0, 4, 8 and 12 of 16.
  assert [d - a[0] for d in a] == [0, 4, 8, 12]
  for bad in (0, timing.DEPTHS + 1):
    with pytest.raises(ValueError, match="depths must be in"):
      timing.seconds_by_depth(["a"], lambda name: None, bad)
  with pytest.raises(ValueError, match="at least one name"):
    timing.seconds_by_depth([], lambda name: None)
  with pytest.raises(ValueError, match="frames must be in"):
    timing.at_stack_depth(lambda: None, timing.DEPTHS)


@pytest.mark.parametrize(
  "parse, argv, message",
  [
    (compile_time.parse_args, ["--depths", "0"], "--depths must be 1 to 16"),
    (compile_time.parse_args, ["--depths", "17"], "--depths must be 1 to 16"),
    (compile_time.parse_args, ["--only", "plain,ours-fp8"], "ours-fp8; the"),
    (compile_time.parse_args, ["--only", ","], "no step; the steps are"),
    (autocast_bench.main, ["--depths", "0"], "--depths must be 1 to 16"),
  ],
)
def test_trace_timing_flags_are_refused_by_name(parse, argv, message, capsys):
  with pytest.raises(SystemExit):
    parse(argv)
  assert message in capsys.readouterr().err


def test_compile_time_steps_are_the_variants_it_builds():
  args = compile_time.parse_args(["--layers", "1", "--d-model", "16"])
  assert tuple(compile_time.variants(gpt_model.GPT, args)) == (
    compile_time.STEPS
  )


def test_gpt2_benchmark_tiny_runs(capsys, tmp_path, monkeypatch):
  # --clocks with nvidia-smi replaced by a program printing its lines, now's
  # local time at 1635 MHz, power-capped, every 2 ms (once, asked for one
  # sample); tests/test_gpu_clock.py tests the sampling itself.
  monkeypatch.setattr(gpu_clock, "available", lambda: True)
  monkeypatch.setattr(
    gpu_clock, "command", lambda ms: _fake_smi.fake_smi(ms, 1635, 0x4, rise=0)
  )
  result = gpt2.main(
    [
      *("--tiny", "--presets", "bf16-mixed", "--batch", "2", "--rounds", "1"),
      *("--steps-per-round", "2", "--warmup", "1", "--no-plain"),
      *("--profile", str(tmp_path), "--clocks", "2"),
    ]
  )
  names = ["hand-bf16", "bf16-mixed", "autocast bf16-mixed"]
  assert [r["step"] for r in result["rows"]] == names
  for row in result["rows"]:
    assert row["tokens_per_s"] > 0 and row["mfu"] is None  # CPU: no peak
    # A round of the tiny model may end between two samples: then no clock.
    clock = row["clock"]
    assert clock is None or (
      clock["sm_mhz_mean"],
      clock["power_capped_share"],
    ) == (1635, 1.0)
  assert result["clock_ms"] == 2 and result["peak_clock_mhz"] is None
  out = capsys.readouterr().out
  assert "| bf16-mixed |" in out
  # --profile: each step's traced round read against its compiled HLO.
  assert list(result["profiles"]) == names
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    "autocast-bf16-mixed",
    "bf16-mixed",
    "hand-bf16",
  ]
  # Each step's compiled HLO beside its trace, the program the trace ran:
  # read back with the trace, it gives the step's profile again.
  for name, p in result["profiles"].items():
    where = tmp_path / name.replace(" ", "-")
    hlo = gzip.decompress((where / "step.hlo.txt.gz").read_bytes()).decode()
    assert hlo.startswith("HloModule jit_")
    again = device_time.summary(overhead.read_trace(where), hlo, 2, False)
    assert again == {k: v for k, v in p.items() if k != "wall_us_per_step"}
  for p in result["profiles"].values():
    # XLA:CPU's thunks each name their instruction.
    assert p["found_in_hlo"] == 1.0 and p["steps"] == 2
    # Every span in one class and under one label.
    assert sum(p["by_class_us"].values()) == pytest.approx(
      p["kernel_us_per_step"]
    )
    assert sum(p["by_label_us"].values()) == pytest.approx(
      p["kernel_us_per_step"]
    )
    assert p["by_class_us"]["matmul"] > 0
    assert 0 < p["busy_us_per_step"] <= p["span_us_per_step"]
    assert p["span_us_per_step"] <= p["wall_us_per_step"]
  # Kernels placed in the model's forward and backward passes.
  labels = [k for p in result["profiles"].values() for k in p["by_label_us"]]
  assert any(k.startswith("fwd ") for k in labels)
  assert any(k.startswith("bwd block*/") for k in labels)
  text = gpt2.profile_table({"gpt2": result})
  assert "| bf16-mixed |" in text and "TFLOP/s in matmul+attention" in text
  p = result["profiles"]["bf16-mixed"]
  # XLA:CPU's thunks each name their instruction: the bytes it moves (its
  # result's and its operands' shapes, read here from the HLO's lines) per
  # launch.
  where = tmp_path / "bf16-mixed"
  hlo = gzip.decompress((where / "step.hlo.txt.gz").read_bytes()).decode()
  defined = {}  # name -> (result's shape text, operand names)
  for line in hlo.splitlines():
    if m := re.match(
      r"\s*(?:ROOT )?%([\w.\-]+) = (.*?)\s([a-z][\w\-]*)\((.*)", line
    ):
      args = m[4][: m[4].index(")")] if ")" in m[4] else ""
      defined[m[1]] = (m[2], re.findall(r"%([\w.\-]+)", args))

  def shape_bytes(text):
    return sum(
      math.prod(int(d) for d in dims.split(",") if d)
      * {"f32": 4, "bf16": 2, "s32": 4, "pred": 1, "u32": 4, "f16": 2}[t]
      for t, dims in re.findall(
        r"\b(f32|bf16|s32|pred|u32|f16)\[([\d,]*)\]", text
      )
    )

  speeds = [k for k in p["kernels"] if "tb_per_s" in k]
  assert len(speeds) >= 30  # all but a few of the 40 longest are XLA's
  for k in speeds:
    shape, operands = defined[k["name"]]
    size = shape_bytes(shape)
    size += sum(shape_bytes(defined[o][0]) for o in dict.fromkeys(operands))
    assert k["mbytes"] == pytest.approx(size * k["per_step"] / 1e6)
    assert k["tb_per_s"] == pytest.approx(size * k["per_step"] / k["us"] / 1e6)
  k = next(k for k in speeds if k["class"] not in ("matmul", "attention"))
  assert (
    f"bf16-mixed, XLA's longest kernels but its matmuls: `{k['name']}`" in text
  )
  ms = [p[k] / 1e3 for k in ("wall_us_per_step", "span_us_per_step")]
  # Back to back, then its MFU: none on a CPU, which has no peak.
  assert f"| bf16-mixed | {ms[0]:.2f} | {ms[1]:.2f} | n/a |" in text
  busy = {n: p["busy_us_per_step"] for n, p in result["profiles"].items()}
  assert (
    "Device busy time against the hand-written bf16 step's: bf16-mixed"
    f" {busy['bf16-mixed'] / busy['hand-bf16']:.3f}x, autocast bf16-mixed"
    f" {busy['autocast bf16-mixed'] / busy['hand-bf16']:.3f}x."
  ) in text
  assert "| bf16-mixed |" in out.split("traced ms/step")[-1]


def test_write_json_keeps_the_whole_file_it_had(monkeypatch, tmp_path):
  # A run killed while writing (a time limit during gpt2.py --profile)
  # leaves the last whole JSON, not a torn one.
  out = tmp_path / "gpt2.json"
  md.write_json(str(out), {"rows": [1]})
  write = pathlib.Path.write_text

  def killed(self, text, *args, **kwargs):
    write(self, text[:5])
    raise KeyboardInterrupt

  monkeypatch.setattr(pathlib.Path, "write_text", killed)
  with pytest.raises(KeyboardInterrupt):
    md.write_json(out, {"rows": [1, 2]})
  assert json.loads(out.read_text()) == {"rows": [1]}


def _recorded_losses(monkeypatch) -> list[tuple[bool, int | None]]:
  """`gpt_model.cross_entropy` replaced by itself recording each call's
  `(one_pass, slices)`, in order, into the list returned."""
  calls, cross_entropy = [], gpt_model.cross_entropy

  def recorded(logits, targets, *, one_pass=True, slices=None):
    calls.append((one_pass, slices))
    return cross_entropy(logits, targets, one_pass=one_pass, slices=slices)

  monkeypatch.setattr(gpt_model, "cross_entropy", recorded)
  return calls


def test_gpt2_profile_that_fails_keeps_the_timings(monkeypatch, tmp_path):
  def broken(*args, **kwargs):
    raise RuntimeError("no trace")

  # The run's loss, GELU and q/k/v layout as --lse, --gelu and --qkv say:
  # each call traced is recorded.
  calls = {"logistic": 0, "qkv": set()}
  losses, gelu = _recorded_losses(monkeypatch), gpt_model.gelu_logistic
  attention_call = gpt_model.CausalSelfAttention.__call__

  def recorded_attention(self, x):
    calls["qkv"].add(self.qkv)
    return attention_call(self, x)

  def recorded_gelu(x):
    calls["logistic"] += 1
    return gelu(x)

  monkeypatch.setattr(gpt_model, "gelu_logistic", recorded_gelu)
  monkeypatch.setattr(
    gpt_model.CausalSelfAttention, "__call__", recorded_attention
  )
  monkeypatch.setattr(device_time, "summary", broken)
  out = tmp_path / "gpt2.json"
  with pytest.raises(RuntimeError, match="no trace"):
    gpt2.main(
      [
        *("--tiny", "--presets", "bf16-mixed", "--autocast", "", "--batch"),
        *("2", "--rounds", "1", "--steps-per-round", "1", "--warmup", "1"),
        *("--no-plain", "--json", str(out), "--profile", str(tmp_path)),
        *("--lse", "two-pass", "--gelu", "logistic", "--qkv", "dense"),
      ]
    )
  saved = json.loads(out.read_text())
  assert [r["step"] for r in saved["rows"]] == ["hand-bf16", "bf16-mixed"]
  assert "profiles" not in saved
  assert {one_pass for one_pass, _ in losses} == {False}
  assert calls["logistic"] > 0
  assert calls["qkv"] == {"dense"}
  assert saved["loss"] == "logits, two-pass LSE" and saved["gelu"] == "logistic"
  assert saved["qkv"] == "dense"
  row = "| bf16-mixed | 2 | 1 | logits, two-pass LSE, GELU via logistic,"
  row += " q/k/v dense;"
  assert row in gpt2.table({"gpt2": saved})  # then the run's XLA_FLAGS


def test_rounding_memory_compiles_each_preset_and_draw_size():
  # Tiny GPT: an update alone and a train step, bf16-lean and stochastic
  # rounding at a draw size of 64 values; MAX_DRAW is put back.
  from jmp_train._src import rounding

  before = rounding.MAX_DRAW
  result = rounding_memory.main(
    [
      *("--layers", "1", "--d-model", "32", "--heads", "4", "--vocab", "64"),
      *("--seq", "8", "--batch", "2", "--max-draw", "64"),
    ]
  )
  rows = result["rows"]
  assert rounding.MAX_DRAW == before
  got = [(r["compiled"], r["preset"], r["max_draw"]) for r in rows]
  assert got == [
    (what, preset, draw)
    for what in ("update alone", "train step, batch 2")
    for preset, draw in (("bf16-lean", None), ("bf16-sr-lean", 64))
  ]
  assert all(r["compile_s"] > 0 and r["temp_mib"] >= 0 for r in rows)
  text = rounding_memory.table({"r": result})
  assert "| train step, batch 2 | bf16-sr-lean | 64 |" in text


def test_gpt2_kernels_counts_the_finite_checks_reductions(capsys):
  # mixed_precision's finite check and gradient norm reduce the gradients,
  # which the hand-written bf16 step does not (XLA:CPU here, which fuses
  # some of them with other reductions; compiled for an H100, the suite's
  # gpt2-kernels-h100, they are one or two kernels per param leaf).
  result = gpt2.main(
    [
      *("--tiny", "--presets", "bf16-mixed", "--batch", "2", "--no-plain"),
      *("--autocast", "", "--kernels"),
    ]
  )
  k = result["kernels"]
  assert list(k) == ["hand-bf16", "bf16-mixed"]
  assert k["bf16-mixed"]["reductions"] > k["hand-bf16"]["reductions"]
  assert k["bf16-mixed"]["total"] > k["hand-bf16"]["total"]
  assert all(v["compile_s"] > 0 for v in k.values())
  text = gpt2.kernels_table({"k": result})
  assert f"| bf16-mixed | {k['bf16-mixed']['total']} |" in text
  assert text.count(f"| {k['bf16-mixed']['compile_s']} |") >= 1
  assert "rows" not in result and gpt2.table({"k": result}).startswith(
    "Not measured"
  )


def test_gpt2_lse_slices_reach_the_loss_and_name_the_run(monkeypatch):
  # --lse-slices N: the one-pass log-sum-exp's rows cut in N parts, in every
  # step compiled, and said in the run's loss label.
  losses = _recorded_losses(monkeypatch)
  argv = [
    *("--tiny", "--presets", "bf16-mixed", "--batch", "2", "--no-plain"),
    *("--autocast", "", "--kernels"),
  ]
  result = gpt2.main([*argv, "--lse-slices", "4"])
  assert set(losses) == {(True, 4)}
  assert result["loss"] == "logits, LSE in 4 slices"
  losses.clear()
  gpt2.main(argv)
  assert set(losses) == {(True, None)}  # the default: gcd(vocabulary, 128)


def test_ptx_loads_reads_each_kernels_loads_by_width(tmp_path, capsys):
  # Written HLO and PTX, as an XLA dump holds them: two fusions of one body
  # (one kernel, named after the first), a cast, and a library call with no
  # PTX of XLA's own; a second module the --module filter leaves out.
  meta = 'metadata={op_name="jit(step)/jvp(cross_entropy)/reduce"}'
  hlo = "\n".join(
    [
      "HloModule jit_step, is_scheduled=true",
      "%add (a: f32[], b: f32[]) -> f32[] {",
      "  %a = f32[] parameter(0)",
      "  %b = f32[] parameter(1)",
      "  ROOT %s = f32[] add(f32[] %a, f32[] %b)",
      "}",
      "%fused_a (p.1: bf16[8,128]) -> f32[8] {",
      "  %p.1 = bf16[8,128]{1,0} parameter(0)",
      "  %c.1 = f32[8,128]{1,0} convert(bf16[8,128]{1,0} %p.1)",
      "  %z.1 = f32[] constant(0)",
      "  ROOT %r.1 = f32[8]{0} reduce(f32[8,128]{1,0} %c.1, f32[] %z.1),"
      " dimensions={1}, to_apply=%add",
      "}",
      "%fused_b (p.2: bf16[8,128]) -> f32[8] {",
      "  %p.2 = bf16[8,128]{1,0} parameter(0)",
      "  %c.2 = f32[8,128]{1,0} convert(bf16[8,128]{1,0} %p.2)",
      "  %z.2 = f32[] constant(0)",
      "  ROOT %r.2 = f32[8]{0} reduce(f32[8,128]{1,0} %c.2, f32[] %z.2),"
      " dimensions={1}, to_apply=%add",
      "}",
      "%fused_c (p.3: f32[8,128]) -> bf16[8,128] {",
      "  %p.3 = f32[8,128]{1,0} parameter(0)",
      "  ROOT %c.3 = bf16[8,128]{1,0} convert(f32[8,128]{1,0} %p.3)",
      "}",
      "ENTRY %main (x: bf16[8,128], y: bf16[8,128], w: f32[8,128]) -> f32[8] {",
      "  %x = bf16[8,128]{1,0} parameter(0)",
      "  %y = bf16[8,128]{1,0} parameter(1)",
      "  %w = f32[8,128]{1,0} parameter(2)",
      "  %input_reduce_fusion = f32[8]{0} fusion(bf16[8,128]{1,0} %x),"
      f" kind=kInput, calls=%fused_a, {meta}",
      "  %input_reduce_fusion.1 = f32[8]{0} fusion(bf16[8,128]{1,0} %y),"
      f" kind=kInput, calls=%fused_b, {meta}",
      "  %loop_convert_fusion = bf16[8,128]{1,0} fusion(f32[8,128]{1,0} %w),"
      " kind=kLoop, calls=%fused_c,"
      ' metadata={op_name="jit(step)/transpose(jvp(GPT))/convert_element_type"}',
      "  %gemm = (bf16[8,8]{1,0}, s8[4]{0}) custom-call(bf16[8,128]{1,0}"
      " %loop_convert_fusion, bf16[8,128]{1,0} %x), custom_call_target="
      '"__cublas$lt$matmul"',
      "  ROOT %out = f32[8]{0} add(f32[8]{0} %input_reduce_fusion,"
      " f32[8]{0} %input_reduce_fusion.1)",
      "}",
    ]
  )
  ptx = """
.visible .entry input_reduce_fusion(
  .param .u64 input_reduce_fusion_param_0
)
{
  ld.global.nc.b16 %rs1, [%rd1];
  ld.global.nc.b16 %rs2, [%rd1+2];
  ld.global.nc.b16 %rs3, [%rd1+4];
  st.global.b32 [%rd2], %f1;
}
.visible .entry loop_convert_fusion(
  .param .u64 loop_convert_fusion_param_0
)
{
  ld.global.nc.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];
  st.global.v2.b32 [%rd2], {%r5, %r6};
  ld.shared.b16 %rs9, [%rd3];
}
.func helper(.param .u64 p)
{
  ld.global.b32 %r7, [%rd4];
}
.entry other
(
  .param .u64 other_param_0
)
{
  ld.global.nc.L1::no_allocate.v4.b16 {%rs1, %rs2, %rs3, %rs4}, [%rd1];
  @%p1 ld.global.nc.L1::no_allocate.v4.b16 {%rs5, %rs6, %rs7, %rs8}, [%rd2];
  red.global.add.f32 [%rd3], %f1;
}
"""
  suffix = ".sm_9.0a_gpu_after_optimizations.txt"
  (tmp_path / f"module_0001.jit_step{suffix}").write_text(hlo)
  (tmp_path / "module_0001.jit_step.2.ptx").write_text(ptx)
  (tmp_path / f"module_0002.jit_lambda{suffix}").write_text(hlo)
  found = ptx_loads.main([str(tmp_path)])
  assert list(found) == ["module_0001.jit_step"]
  convert, reduce = found["module_0001.jit_step"]  # most bytes first
  assert reduce == {
    "label": "fwd cross_entropy/reduce",
    "kernel": "input_reduce_fusion",
    "launches": 2,
    "mbytes": 2 * (8 * 128 * 2 + 8 * 4) / 1e6,
    "loads": "3 b16",
    "stores": "1 b32",
  }
  assert convert["launches"] == 1 and convert["kernel"] == "loop_convert_fusion"
  assert convert["mbytes"] == 8 * 128 * (4 + 2) / 1e6
  assert (convert["loads"], convert["stores"]) == ("1 v4.b32", "1 v2.b32")
  assert convert["label"] == "bwd GPT/convert_element_type"
  out = capsys.readouterr().out
  assert "| fwd cross_entropy/reduce | 2 | 0 | 3 b16 | 1 b32 |" in out
  # A bare `.entry`, cache modifiers and a predicate: loads by width; an
  # atomic reduction with the stores; a `.func` not counted in the entry
  # before it.
  each = ptx_loads.accesses(ptx)
  assert each["other"] == {("ld", "v4.b16"): 2, ("st", "red.add.f32"): 1}
  assert each["loop_convert_fusion"] == {
    ("ld", "v4.b32"): 1,
    ("st", "v2.b32"): 1,
  }
  assert ptx_loads.accesses("no kernels here") == {}
  with pytest.raises(SystemExit):
    ptx_loads.main([str(tmp_path), "--module", "jit_train"])
  assert "no module of" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    ptx_loads.main([str(tmp_path / "missing")])
  assert "is not a folder" in capsys.readouterr().err
  for top in ("0", "-1"):  # -1 would drop the last row, not show them all
    with pytest.raises(SystemExit):
      ptx_loads.main([str(tmp_path), "--top", top])
    assert f"must be >= 1, got {top}" in capsys.readouterr().err
  (tmp_path / "module_0001.jit_step.2.ptx").unlink()  # jax 0.11, no flag
  ptx_loads.main([str(tmp_path)])
  assert "--xla_dump_emitter_re" in capsys.readouterr().out


def test_count_reductions_counts_kernels_as_kernel_list_does():
  # Fusions whose fused computation reduces, and bare reduces, among the
  # kernels `kernel_list` counts: of a conditional, its larger branch only.
  hlo = "\n".join(
    [
      "%fused_a (p: f32[4]) -> f32[] {",
      "  ROOT %r = f32[] reduce(f32[4] %p, f32[] %c), to_apply=%add",
      "}",
      "%fused_b (p: f32[4]) -> f32[4] {",
      "  ROOT %m = f32[4] multiply(f32[4] %p, f32[4] %p)",
      "}",
      "%small (x: f32[4]) -> f32[] {",
      "  ROOT %s = f32[] fusion(f32[4] %x), kind=kInput, calls=%fused_a",
      "}",
      "%large (x: f32[4]) -> f32[] {",
      "  %l1 = f32[4] fusion(f32[4] %x), kind=kLoop, calls=%fused_b",
      "  ROOT %l2 = f32[] fusion(f32[4] %l1), kind=kInput, calls=%fused_a",
      "}",
      "ENTRY %main (x: f32[4], b: pred[]) -> f32[] {",
      "  %f1 = f32[] fusion(f32[4] %x), kind=kInput, calls=%fused_a",
      "  %f2 = f32[4] fusion(f32[4] %x), kind=kLoop, calls=%fused_b",
      "  %f3 = f32[] reduce(f32[4] %f2, f32[] %c), to_apply=%add",
      "  ROOT %f4 = f32[] conditional(pred[] %b, f32[4] %x, f32[4] %x),"
      " true_computation=%small, false_computation=%large",
      "}",
    ]
  )
  assert [op for op, _ in overhead.kernel_list(hlo)] == ["fusion"] * 2 + [
    "reduce",
    "fusion",
    "fusion",
  ]
  assert overhead.count_reductions(hlo) == 3  # f1, f3 and the larger's l2


def test_torch_side_by_side_verdicts_come_from_tokens_per_s():
  def run(framework, rows, n_params=100, device="H100"):
    result = dict(model="GPT", batch=16, device=device, n_params=n_params)
    result.update(peak_bf16_tflops=None)
    result["rows"] = [
      dict(step=name, ms=1.0, steps_per_s=1.0, tokens_per_s=tokens)
      | dict(tflops=1.0, mfu=None, ratio_vs_plain=1.0)
      for name, tokens in rows
    ]
    if framework:
      result.update(framework="torch 2.11.0", torch_compile=True)
    return result

  ours = run(None, [("bf16-mixed", 1000), ("fp16-mixed", 990)])
  theirs = run("torch", [("torch bf16", 1000), ("torch fp16", 1000)])
  text = gpt2.torch_table({"gpt2": ours, "gpt2-torch": theirs})
  assert (
    "| bf16 | bf16-mixed, loss logits | 1,000 | 1,000 | 1.000x | **met** |"
    in text
  )
  assert (
    "| fp16 | fp16-mixed, loss logits | 990 | 1,000 | 0.990x | **not met** |"
    in text
  )
  assert "same model" not in text
  # The page's table of jmp_train rows leaves the PyTorch run out.
  assert "torch bf16" not in gpt2.table({"gpt2": ours, "gpt2-torch": theirs})
  # A fused-loss run is a row of its own beside the whole-logits one.
  fused = run(None, [("bf16-mixed", 1100)]) | {"loss": "fused, chunks of 8"}
  text = gpt2.torch_table({"a": ours, "b": theirs, "c": fused})
  assert "| bf16 | bf16-mixed, loss logits | 1,000 | 1,000 | 1.000x |" in text
  assert (
    "| bf16 | bf16-mixed, loss fused, chunks of 8 | 1,100 | 1,000 | 1.100x | **met** |"
    in text
  )
  # Missing rows say so; a different model or device is not compared.
  text = gpt2.torch_table({"a": run(None, [("bf16-mixed", 1)]), "b": theirs})
  assert "| fp16 | fp16-mixed, loss logits | not measured |" in text
  other = run("torch", [("torch bf16", 1000)], n_params=101)
  assert "Not known to be the same model" in gpt2.torch_table(
    {"a": ours, "b": other}
  )
  h200 = run("torch", [("torch bf16", 1000)], device="H200")
  assert "No jmp_train run on this device" in gpt2.torch_table(
    {"a": ours, "b": h200}
  )

  # Each PyTorch run beside jmp_train's runs that waited as often: a run of
  # 30 steps per wait is not compared with one of 5, however fast.
  def every(n, r):
    return dict(r, steps_per_round=n)

  steady = every(30, run(None, [("bf16-mixed", 1200), ("fp16-mixed", 1150)]))
  theirs_steady = every(30, run("torch", [("torch bf16", 1100)]))
  text = gpt2.torch_table(  # the PyTorch runs in neither order
    {
      "d": theirs_steady,
      "a": every(5, ours),
      "b": steady,
      "c": every(5, theirs),
    }
  )
  # One block per PyTorch run, fewest steps per wait first; each block's
  # first line names the model ("GPT, batch 16, ...").
  five, thirty = text.split("GPT, batch 16, ")[1:]
  assert five.startswith("5 steps per wait") and "fused" not in five
  assert "| bf16 | bf16-mixed, loss logits | 1,000 | 1,000 | 1.000x |" in five
  assert "| fp16 | fp16-mixed, loss logits | 990 | 1,000 | 0.990x |" in five
  assert thirty.startswith("30 steps per wait")
  assert "| bf16 | bf16-mixed, loss logits | 1,200 | 1,100 | 1.091x |" in thirty
  assert "| fp16 | fp16-mixed, loss logits | not measured |" in thirty
  alone = gpt2.torch_table({"a": every(5, ours), "d": theirs_steady})
  assert "as many steps per wait to compare" in alone


def test_loss_head_reads_xla_temporaries_of_both_losses(monkeypatch):
  losses = _recorded_losses(monkeypatch)
  result = loss_head.main(
    [
      *("--batch", "2", "--seq", "128", "--d-model", "64"),
      *("--vocab", "4096", "--chunks", "16,64", "--lse-slices", "16,4"),
    ]
  )
  rows = {r["variant"]: r for r in result["rows"]}
  temps = {name: r["temp_bytes"] for name, r in rows.items()}
  optax_loss = "logits, optax's loss"
  two_pass = "logits, two-pass logsumexp"
  assert list(temps) == [
    "logits",
    "logits, LSE in 16 slices",
    "logits, LSE in 4 slices",
    two_pass,
    optax_loss,
    "fused (chunk 16)",
    "fused (chunk 64)",
  ]
  # 256 rows x 4096 logits: float32 logits of 16 or 64 rows at a time need
  # less than all 256 rows' logits and their float32 copies.
  assert temps["fused (chunk 16)"] < temps["fused (chunk 64)"] < temps["logits"]
  # The written-out backward pass keeps no float32 softmax beside the
  # logits.
  assert temps["logits"] < temps[optax_loss]
  # The one-pass log-sum-exp reads the logits once where the two-pass one
  # reads them twice.
  assert 0 < rows["logits"]["mbytes"] < rows[two_pass]["mbytes"]
  # --lse-slices 16,4: those rows' losses cut the rows in 16 and 4 parts,
  # the first in the default's (gcd(4096, 128) = 128, None); then the
  # two-pass loss.
  assert losses == [(True, None), (True, 16), (True, 4), (False, None)]
  # A loop's kernels would be counted once, not per chunk: left out.
  assert rows["fused (chunk 16)"]["mbytes"] is None
  assert "ms" not in result["rows"][0]  # CPU: not run, not timed
  text = loss_head.table({"loss-head": result})
  assert "| fused (chunk 16) |" in text and "(a loop)" in text


def test_count_kernels_reads_entry_branches_and_loops():
  # Written HLO: 1 kernel in the entry, a conditional whose larger branch
  # has 3, a while loop with 1 in its condition and 2 in its body, a call
  # (XLA:GPU's command buffers) of a computation with 1, and a call XLA:CPU
  # marks small, which it runs as one kernel whatever it calls.
  hlo = """
%small (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  ROOT %n = f32[] negate(%p)
}

%big (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %a = f32[] fusion(%p), kind=kLoop, calls=%f
  %b = f32[] copy(%a)
  ROOT %c = f32[] fusion(%b), kind=kLoop, calls=%f
}

%cond (p: f32[]) -> pred[] {
  %p = f32[] parameter(0)
  ROOT %lt = pred[] compare(%p, %p), direction=LT
}

%body (p: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %e = f32[] exponential(%p)
  ROOT %f = f32[] fusion(%e), kind=kLoop, calls=%f
}

ENTRY %main (x: f32[], i: s32[]) -> f32[] {
  %x = f32[] parameter(0)
  %i = s32[] parameter(1)
  %k = f32[] constant(1)
  %s = f32[] add(%x, %k)
  %r = f32[] conditional(%i, %s, %s), branch_computations={%small, %big}
  %w = f32[] while(%r), condition=%cond, body=%body
  %c = f32[] call(%w), to_apply=%small
  %l = f32[] call(%c), to_apply=%big, frontend_attributes={xla_cpu_small_call="true"}
  %t = (f32[]) tuple(%l)
  ROOT %g = f32[] get-tuple-element(%t), index=0
}
"""
  assert overhead.count_kernels(hlo) == {
    "add": 1,  # the entry's; its constant, tuple and parameters launch none
    "fusion": 3,  # two in the larger branch, one in the loop body
    "copy": 1,
    "compare": 1,
    "exponential": 1,
    "negate": 1,  # in the called computation
    "call": 1,  # the small call, not the three kernels of %big
  }
  # A real compiled step: ours launches more kernels than plain adam.
  result = overhead.main(["--dims", "16,32,4", "--kernels", "--update-only"])
  kernels = {k: v["total"] for k, v in result["kernels"].items()}
  assert kernels["ours"] > kernels["plain"] > 0
  assert "| ours |" in overhead.kernels_table({"k": result})


def test_kernel_bytes_are_operands_and_results_by_hand():
  import jax

  # Shapes chosen so each kernel's bytes are a sum to do by hand: f32[4,8]
  # is 128 bytes, f32[8] 32, bf16[4,8] 64, pred[] 1, s32[] 4.
  hlo = """
%fused_a (p0: f32[4,8], p1: f32[8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  ROOT %r = f32[4,8]{1,0} add(%p0, %p0)
}

%big (q: f32[4,8]) -> f32[4,8] {
  %q = f32[4,8]{1,0} parameter(0)
  %h = bf16[4,8]{1,0} convert(%q)
  ROOT %o = f32[4,8]{1,0} fusion(%q, %h), kind=kLoop, calls=%fused_a
}

%small (q: f32[4,8]) -> f32[4,8] {
  ROOT %q = f32[4,8]{1,0} parameter(0)
}

ENTRY %main (x: f32[4,8], b: f32[8], i: s32[]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %b = f32[8]{0} parameter(1)
  %i = s32[] parameter(2)
  %two = (f32[4,8]{1,0}, pred[]) fusion(%x, %b), kind=kLoop, calls=%fused_a
  %y = f32[4,8]{1,0} get-tuple-element(%two), index=0
  %c = f32[4,8]{1,0} conditional(%i, %y, %y), branch_computations={%small, %big}
  ROOT %z = f32[4,8]{1,0} fusion(%c, %b), kind=kLoop, calls=%fused_a
}
"""
  assert overhead.kernel_list(hlo) == [
    ("fusion", 128 + 32 + (128 + 1)),  # two operands, a tuple result
    ("convert", 128 + 64),  # in the larger branch, read from its parameter
    ("fusion", 128 + 64 + 128),
    ("fusion", 128 + 32 + 128),  # the conditional's result is an operand
  ]
  assert overhead.count_kernels(hlo) == {"fusion": 3, "convert": 1}
  # An operand read twice is moved once; sub-byte types round up; an
  # element type the table does not know is refused, not counted as 0.
  twice = "ENTRY %m (a: f32[8]) -> f32[8] {\n  %a = f32[8]{0} parameter(0)\n"
  twice += "  ROOT %f = f32[8]{0} fusion(%a, %a), kind=kLoop, calls=%g\n}\n"
  assert overhead.kernel_list(twice) == [("fusion", 32 + 32)]
  assert overhead._shape_bytes("(s4[3]{0}, c64[2]{0})") == 2 + 16
  with pytest.raises(ValueError, match="unknown HLO element type 'q7'"):
    overhead._shape_bytes("q7[3]")
  # Real compiled text (metadata, layouts): x * y + 1 on 1000 float32s is
  # one fusion that reads x and y and writes the result, 4000 bytes each.
  x = jax.numpy.ones(1000)
  real = jax.jit(lambda x, y: x * y + 1.0).lower(x, x).compile().as_text()
  assert overhead.kernel_list(real) == [("fusion", 3 * 4000)]


def test_kernel_bytes_leave_out_cublas_and_cudnn_workspace():
  # XLA:GPU's cuBLAS and cuDNN calls return their workspace last, a flat s8
  # or u8 array, whose size the chip's autotuning picks: scratch, not data.
  # Lines as the H200's compiled step has them (shortened); bf16[4,8] is 64
  # bytes, f32[4] 16, bf16[4,4] 32.
  hlo = """
ENTRY %main (x: bf16[4,8], w: bf16[8,4], q: bf16[4,4]) -> bf16[4,4] {
  %x = bf16[4,8]{1,0} parameter(0)
  %w = bf16[8,4]{1,0} parameter(1)
  %q = bf16[4,4]{1,0} parameter(2)
  %mm = (bf16[4,4]{1,0}, s8[33554432]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", backend_config={}
  %y = bf16[4,4]{1,0} get-tuple-element(%mm), index=0
  %at = (bf16[4,4]{1,0}, f32[4]{0}, u8[51118336]{0}) custom-call(%q, %y), custom_call_target="__cudnn$fmhaSoftmax"
  %o = bf16[4,4]{1,0} get-tuple-element(%at), index=0
  %six = (bf16[4,4]{1,0}, bf16[4,4]{1,0}, bf16[4,4]{1,0}, bf16[4,4]{1,0}, bf16[4,4]{1,0}, /*index=5*/u8[1000]{0}) custom-call(%o), custom_call_target="__cudnn$fmhaSoftmaxBackward"
  %z = bf16[4,4]{1,0} get-tuple-element(%six), index=0
  %none = (bf16[4,4]{1,0}, u8[0]{0}) custom-call(%z), custom_call_target="__cudnn$fmhaSoftmax"
  %n = bf16[4,4]{1,0} get-tuple-element(%none), index=0
  %flat = bf16[4,4]{1,0} custom-call(%n, %n), custom_call_target="__cublas$gemm"
  %mine = (bf16[4,4]{1,0}, u8[100]{0}) custom-call(%flat), custom_call_target="my_op"
  %m = bf16[4,4]{1,0} get-tuple-element(%mine), index=0
  %two = (bf16[4,4]{1,0}, s8[2,3]{1,0}) custom-call(%m), custom_call_target="__cublas$lt$matmul"
  %r = bf16[4,4]{1,0} get-tuple-element(%two), index=0
  %s = ((bf16[4,4]{1,0}), (bf16[4,4]{1,0}, s8[64]{0})) custom-call-start(%r), custom_call_target="__cublas$lt$matmul"
  ROOT %d = (bf16[4,4]{1,0}, s8[64]{0}) custom-call-done(%s)
}
"""
  assert overhead.kernel_list(hlo) == [
    ("custom-call", 64 + 64 + 32),  # x, w and the product
    ("custom-call", 32 + 32 + 32 + 16),  # q, y, the output and its stats
    ("custom-call", 32 + 5 * 32),  # the workspace after /*index=5*/
    ("custom-call", 32 + 32),  # a workspace of none
    ("custom-call", 32 + 32),  # no tuple: nothing to leave out
    ("custom-call", 32 + 32 + 100),  # not XLA's library call: all counted
    ("custom-call", 32 + 32 + 6),  # a last array of rank 2 is not scratch
    # The async form is counted as it was, not refused.
    ("custom-call-start", 32 + 32 + 32 + 64),
    ("custom-call-done", (32 + 32 + 64) + (32 + 64)),
  ]


def test_kernel_bytes_read_a_tuple_element_named_with_a_hash():
  # XLA:GPU's dumped HLO (jax 0.11) names an element of a tuple-shaped
  # operand `%name#k`, where `as_text()` has a get-tuple-element: the
  # element's bytes, not the whole tuple's. bf16[4,8] is 64 bytes, bf16[4,4]
  # 32, f32[4] 16.
  lines = [
    "ENTRY %main (x: bf16[4,8], w: bf16[8,4]) -> bf16[4,4] {",
    "  %x = bf16[4,8]{1,0} parameter(0)",
    "  %w = bf16[8,4]{1,0} parameter(1)",
    "  %mm = (bf16[4,4]{1,0}, f32[4]{0}, s8[64]{0}) custom-call(%x, %w),"
    ' custom_call_target="__cublas$lt$matmul"',
    "  %f = bf16[4,4]{1,0} fusion(%mm#0, %mm#1), kind=kLoop, calls=%c",
    "  ROOT %g = bf16[4,4]{1,0} fusion(%mm#1, %f, %mm#1), kind=kLoop, calls=%c",
    "}",
  ]
  assert overhead.kernel_list("\n".join(lines)) == [
    ("custom-call", 64 + 64 + 32 + 16),  # its workspace left out
    ("fusion", 32 + 16 + 32),  # elements 0 and 1, and its result
    ("fusion", 16 + 32 + 32),  # element 1 once, f, the result
  ]


def test_kernels_table_says_which_conditionals_are_left():
  result = overhead.main(["--dims", "16,32,4", "--kernels", "--update-only"])
  k = result["kernels"]
  # On XLA:CPU the skip stays a conditional; plain adam has none to keep.
  assert (k["plain"]["conditionals"], k["skip-only"]["conditionals"]) == (0, 1)
  assert k["ours"]["mbytes"] > 0
  text = overhead.kernels_table({"k": result})
  assert "MB moved" in text
  assert "conditionals left in the compiled step: plain 0, skip-only 1" in text


@pytest.fixture
def platforms_restored():
  """JAX's `jax_platforms` as it was before the test: `deviceless.start`
  (a script's `--target`) asks JAX for no GPU."""
  import jax

  platforms = jax.config.jax_platforms
  yield platforms
  jax.config.update("jax_platforms", platforms)


def test_deviceless_target_is_checked_and_needs_the_plugin(platforms_restored):
  import deviceless
  import jax

  with pytest.raises(
    ValueError, match=r"target must be one of \['h100', 'h200'\]"
  ):
    deviceless.topology("a100")
  assert deviceless.start(None) is None  # no target: JAX left as it was
  assert jax.config.jax_platforms == platforms_restored
  if suite.cuda_plugin():
    pytest.skip("JAX's CUDA plugin is installed: the refusal cannot happen")
  flags = os.environ.get("XLA_FLAGS")
  for refused in (
    lambda: deviceless.topology("h100"),
    lambda: deviceless.start("h100"),
  ):
    with pytest.raises(
      RuntimeError,
      match=r'needs JAX.s CUDA plugin: pip install "jax\[cuda12\]==',
    ):
      refused()
    assert os.environ.get("XLA_FLAGS") == flags  # refused: left as it was


def test_deviceless_h200_is_the_lent_chip_with_its_own_memory():
  # The H200 target bears the name JAX gives that chip (`device_kind`, as
  # the H200 runs of 2026-11-26 and 2026-11-27 recorded it), and differs
  # from the H100's only in its memory: 141 GB of HBM3e at 4.8 TB/s against
  # 80 GB of HBM3 at 3.35 TB/s, the same GH100 chip.
  import deviceless

  assert deviceless.name("h200") == "NVIDIA H200"
  assert deviceless.name("h100") == "NVIDIA H100 80GB HBM3"

  def fields(target):
    return dict(
      re.findall(r"^\s*(\w+): (.+)$", deviceless.TARGETS[target], re.M)
    )

  h100, h200 = fields("h100"), fields("h200")
  differ = {k for k in h100.keys() | h200.keys() if h100.get(k) != h200.get(k)}
  assert differ == {
    "memory_bandwidth",
    "device_memory_size",
    "device_description_str",
  }
  assert int(h200["memory_bandwidth"]) == 4.8e12
  assert int(h200["device_memory_size"]) == 143771 * 1024 * 1024
  assert int(h100["core_count"]) == 132


def test_deviceless_compiles_with_the_chips_gemms(
  monkeypatch, platforms_restored
):
  # A compile for a target takes cuBLAS's GEMMs, as the H200's autotuning
  # chose, unless XLA_FLAGS already sets the flag; the record names the
  # XLA:GPU flags, not the others. (The topology is stood in for: JAX's
  # CUDA plugin is not a dependency.)
  import deviceless

  monkeypatch.setattr(deviceless, "topology", lambda target: f"topo {target}")
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert deviceless.start("h100") == "topo h100"
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=false"
  assert deviceless.machine("h100").startswith(
    "NVIDIA H100 80GB HBM3 (compiled here; XLA_FLAGS"
    " --xla_gpu_enable_triton_gemm=false, not run)"
  )
  # Another flag, even one whose value holds the flag's name, is kept and
  # not taken for a choice; a dump path is not recorded.
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/d/xla_gpu_enable_triton_gemm")
  deviceless.start("h100")
  assert os.environ["XLA_FLAGS"] == (
    "--xla_dump_to=/d/xla_gpu_enable_triton_gemm"
    " --xla_gpu_enable_triton_gemm=false"
  )
  assert "xla_dump_to" not in deviceless.machine("h100")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
  deviceless.start("h100")
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true"
  monkeypatch.delenv("XLA_FLAGS")
  assert "H100 80GB HBM3 (compiled here, not run)" in deviceless.machine("h100")

  # Refused (no plugin): XLA_FLAGS as it was, set or not.
  def refused(target):
    raise RuntimeError("needs JAX's CUDA plugin")

  monkeypatch.setattr(deviceless, "topology", refused)
  for flags in ("--xla_dump_to=d", None):
    if flags is None:
      monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
      monkeypatch.setenv("XLA_FLAGS", flags)
    with pytest.raises(RuntimeError, match="CUDA plugin"):
      deviceless.start("h100")
    assert os.environ.get("XLA_FLAGS") == flags


def test_suite_skips_a_deviceless_job_without_the_plugin(
  tmp_path, capsys, monkeypatch
):
  assert suite.DEVICELESS <= set(suite.CPU_JOBS)
  monkeypatch.setattr(suite, "gpu_kind", lambda: None)
  monkeypatch.setattr(suite, "cuda_plugin", lambda: False)
  ran = []

  def run_job(name, job, where, timeout=None):
    ran.append(name)
    return 0.0

  monkeypatch.setattr(suite, "run_job", run_job)
  monkeypatch.setattr(suite, "render", lambda *a: "page")
  argv = ["--json-dir", str(tmp_path), "--out", str(tmp_path / "B.md")]
  # Named in --only: not done is a failure; the other job still runs.
  with pytest.raises(SystemExit, match="failed: overhead-kernels-h100$"):
    suite.main([*argv, "--only", "overhead-kernels-h100,host-cost"])
  assert ran == ["host-cost"]
  assert "overhead-kernels-h100: skipped, it needs JAX's CUDA plugin" in (
    capsys.readouterr().out
  )
  # In a whole run it is skipped with its line, not failed.
  monkeypatch.setattr(
    suite, "CPU_JOBS", {"overhead-kernels-h100": "x.py", "host-cost": "y.py"}
  )
  ran.clear()
  suite.main(argv)
  assert ran == ["host-cost"]
  assert "overhead-kernels-h100: skipped, it needs JAX's CUDA plugin" in (
    capsys.readouterr().out
  )


def test_host_cost_runs_and_renders():
  import host_cost

  layers = 2
  result = host_cost.main(
    [
      "--layers",
      str(layers),
      "--steps-per-round",
      "2",
      "--rounds",
      "2",
      "--warmup",
      "1",
    ]
  )
  assert result["param_leaves"] == 2 * layers
  # Arrays in each state, by the written rule: adam keeps a count and mu and
  # nu per param; jmp-style adds the loss scale and its counter; ours adds
  # those and its five counters and flags (steps, skipped steps, last step
  # finite, grad norm, skip streak), and no master for a float32 param.
  adam = 1 + 2 * (2 * layers)
  assert result["state_leaves"] == {
    "plain": adam,
    "skip-only": adam,
    "ours": adam + 2 + 5,
    "jmp-style": adam + 2,
    "plain + loss scale": adam + 2,
    "plain + counters": adam + 5,
    "plain + masters": adam,  # None per float32 param: no arrays
    "plain + MaskedNode masters": adam,
  }
  steps = ["plain", "skip-only", "ours", "jmp-style"]
  assert list(result["step_us"]) == steps
  assert list(result["call_us"]) == steps + list(host_cost.PARTS)
  for times in (result["step_us"], result["call_us"]):
    assert all(t > 0 for t in times.values())
  text = host_cost.table({"r": result})
  assert f"| full train step, {2 * layers} params | ours | {adam + 7} |" in text
  assert f"| plain + counters | {adam + 5} |  |" in text  # no step to time
  assert "Each part of ours's state added alone to plain's: loss scale" in text
  assert "(with an optax.MaskedNode per param, the placeholder until" in text
  assert host_cost.table({}).startswith("Not measured")


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--layers", "0"], "argument --layers: must be >= 1, got 0"),
    (["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
  ],
)
def test_host_cost_refuses_bad_settings(argv, message, capsys):
  import host_cost

  with pytest.raises(SystemExit):
    host_cost.parse_args(argv)
  assert message in capsys.readouterr().err


def test_gpt_compare_saves_the_runs_without_history(tmp_path, monkeypatch):
  # The example's own run is tested in test_gpt_example; here, what the
  # benchmark keeps of it and where the chart goes.
  calls = []

  def fake_main(argv):
    calls.append(argv)
    out = pathlib.Path(argv[argv.index("--out") + 1]) / "gpt-compare"
    out.mkdir(parents=True)
    (out / "curves.png").write_bytes(b"png")
    config = dict(layers=1, d_model=8, steps=2, batch_size=2, seq_len=4)
    return [
      dict(
        preset=p,
        config=config,
        history=[1, 2],
        first_loss=5.0,
        final_val_loss=2.0,
        skipped_steps=0,
        final_loss_scale=1.0,
        seconds=1.0,
      )
      for p in gpt_compare.PRESETS.split(",")
    ]

  monkeypatch.setattr(gpt_compare.gpt, "main", fake_main)
  result = gpt_compare.main(
    ["--chart", str(tmp_path / "c.png"), "--json", str(tmp_path / "g.json")]
    + ["--steps", "2"]
  )
  assert calls[0][:2] == ["--compare", gpt_compare.PRESETS]
  assert calls[0][-2:] == ["--steps", "2"]  # the example's own flags pass on
  saved = json.loads((tmp_path / "g.json").read_text())
  assert saved == result
  assert [r["preset"] for r in saved["runs"]] == gpt_compare.PRESETS.split(",")
  assert all("history" not in r for r in saved["runs"])
  assert (tmp_path / "c.png").read_bytes() == b"png"


def test_lean_state_verdicts_follow_the_numbers():
  results, _, _ = saved_results()
  gpt = results["lean-gpt"]
  base = gpt["runs"][0]["final_val_loss"]

  def with_loss(preset, loss):
    runs = [
      dict(r, final_val_loss=loss) if r["preset"] == preset else r
      for r in gpt["runs"]
    ]
    return lean_state.quality_table({"lean-gpt": dict(gpt, runs=runs)})

  def row_verdict(text, preset):
    (row,) = [r for r in text.split("\n") if r.startswith(f"| {preset} |")]
    return re.search(r"\*\*(met|not met)\*\*", row)[1]

  # bf16 moments: within 0.01; FP8 moments: within 0.02, either side.
  for loss, want in ((base + 0.009, "met"), (base + 0.011, "not met")):
    assert row_verdict(with_loss("bf16-lean", loss), "bf16-lean") == want
  for loss, want in ((base - 0.019, "met"), (base + 0.021, "not met")):
    assert row_verdict(with_loss("bf16-sr-coat", loss), "bf16-sr-coat") == want
  memory = results["lean-memory"]
  text = lean_state.memory_table({"lean-memory": memory})
  assert verdict(text, "bf16-remainders at 14 B/param") == "met"
  rows = [
    dict(r, total=r["total"] + 0.02 * memory["n_params"])
    if r["preset"] == "bf16-remainders"
    else r
    for r in memory["rows"]
  ]
  text = lean_state.memory_table({"lean-memory": dict(memory, rows=rows)})
  assert verdict(text, "bf16-remainders at 14 B/param") == "not met"


def test_autocast_table_verdict_follows_the_gap():
  cost = {"trace_s": 1.0, "compile_s": 2.0, "step_ms": 3.0}
  run = {"steps": 400}

  def result(gap):
    return {
      "preset": "bf16-mixed",
      "config": dict(layers=2, d_model=128, heads=4, seq_len=64, batch_size=32),
      "cost": {"linen.wrap": cost, "autocast": dict(cost, step_ms=6.0)},
      "runs": {
        "linen.wrap": dict(run, final_val_loss=2.0),
        "autocast": dict(run, final_val_loss=2.0 + gap),
      },
    }

  met = autocast_bench.table({"a": result(-0.004)})
  assert "-0.0040; goal within 0.01: **met**" in met
  assert (
    "| autocast | 1.9960 | 1.00 (1.000x) | 2.00 (1.000x) | 6.0 (2.000x) |"
    in met
  )
  assert "**not met**" in autocast_bench.table({"a": result(0.02)})


def test_gpt2_memory_tiny_checks_the_table_against_xla(tmp_path):
  hlo = tmp_path / "hlo" / "bf16-mixed.hlo.txt.gz"
  result = gpt2_memory.main(
    ["--tiny", "--batch", "2", "--steps", "1", "--hlo", str(hlo)]
  )
  pred, comp = result["predicted"], result["compiled"]
  # --hlo: the step that ran, as compiled: its entry computation takes the
  # donated state and the tokens, s32[2,65].
  text = gzip.decompress(hlo.read_bytes()).decode()
  assert text.startswith("HloModule jit_") and "s32[2,65]" in text
  assert "input_output_alias" in text.split("\n")[0]
  parts = ("params", "gradients", "master_weights", "optimizer_state")
  assert pred["total"] == sum(pred[k] for k in (*parts, "other_state"))
  # memory_table's written rule: the step's arguments are the state less
  # its gradients, plus the batch (2 x 65 int32 tokens); XLA leaves out the
  # few scalars this step never reads (bf16-mixed has no loss scale to grow).
  rule = pred["total"] - pred["gradients"] + 2 * 65 * 4
  assert 0 <= rule - comp["argument"] <= 16
  # bf16-mixed: float32 params, no masters, Adam's two float32 moments.
  assert pred["master_weights"] == 0 and pred["gradients"] == pred["params"]
  # (plus scalars: Adam's count, the loss-scale state and its counters)
  assert 0 <= pred["optimizer_state"] - 2 * pred["params"] <= 64
  assert result["peak_bytes_in_use"] is None or result["peak_bytes_in_use"] > 0
  assert not result["compiled_only"]
  # A step that ran keeps the peak columns, n/a where the device reports no
  # peak (a CPU), and says what the peak is.
  text = gpt2_memory.table({"m": result})
  assert "| peak | peak / step |" in text and "peak_bytes_in_use" in text
  if result["peak_bytes_in_use"] is None:
    assert text.endswith("| n/a | n/a |")
  # A step compiled for a GPU without one (--target) has no peak: a table of
  # its own, without the peak columns, beside the runs on a device.
  compiled = dict(result, device="H100 (compiled here, not run)")
  compiled["compiled_only"] = True
  text = gpt2_memory.table({"gpu": result, "here": compiled})
  first, second = text.split("\n\nGPT ")
  assert "| peak | peak / step |" in first and "H100" not in first
  assert "H100 (compiled" in second and "| peak" not in second
  assert "(no peak)" in second
  assert first.count("| bf16-mixed |") == second.count("| bf16-mixed |") == 1


@pytest.mark.parametrize(
  "main, argv",
  [
    (gpt2_memory.main, ["--target", "h100"]),
    (gpt2.main, ["--kernels", "--target", "h100"]),
  ],
  ids=["gpt2_memory", "gpt2"],
)
def test_gpt2_target_needs_the_plugin_before_any_work(
  main, argv, monkeypatch, platforms_restored
):
  if suite.cuda_plugin():
    pytest.skip("JAX's CUDA plugin is installed: the refusal cannot happen")
  # The 124M-param model is not built: the refusal comes first.
  monkeypatch.setattr(gpt2, "config", lambda tiny: pytest.fail("built"))
  with pytest.raises(RuntimeError, match="needs JAX.s CUDA plugin"):
    main(argv)


def _span(name, ts, dur, tid, pid=1, **args):
  return dict(ph="X", name=name, ts=ts, dur=dur, pid=pid, tid=tid, args=args)


def test_trace_summary_reads_a_gpu_trace():
  # Written as jax.profiler's perfetto trace of a GPU: a host process with
  # the jitted calls, a device process with two stream lines and lines
  # derived from their kernels (which must not count twice).
  lines = ["Stream #7", "Stream #8", "XLA Ops", "Async XLA Ops", "Launch Stats"]
  meta = [
    dict(ph="M", name="process_name", pid=1, args={"name": "/host:CPU"}),
    dict(ph="M", name="process_name", pid=2, args={"name": "/device:GPU:0"}),
  ] + [
    dict(ph="M", name="thread_name", pid=2, tid=7 + i, args={"name": line})
    for i, line in enumerate(lines)
  ]
  work = [  # two steps
    _span("k1", 0, 10, 7, pid=2, hlo_op="multiply_fusion.3"),
    _span("k2", 5, 10, 8, pid=2, hlo_op="multiply_fusion.9"),  # overlaps k1
    _span("k3", 30, 4, 7, pid=2, hlo_op="dot"),
    _span("k4", 100, 10, 7, pid=2, hlo_op="multiply_fusion.3"),
    _span("MemcpyD2H", 120, 2, 8, pid=2),  # a transfer, not a kernel
    _span("k6", 130, 4, 7, pid=2, hlo_op="dot"),
    # Kernels without an hlo_op: kinds from their names, number dropped.
    _span("loop_add_fusion_3", 140, 2, 7, pid=2),
    _span("loop_add_fusion_12", 141, 2, 8, pid=2),  # overlaps the one above
  ]
  derived = [
    dict(e, tid=tid) for tid in (9, 10, 11) for e in work
  ]  # each on every derived line
  host = [
    _span("PjitFunction(ours)", -50, d, 3) for d in (30.0, 10.0, 20.0)
  ] + [_span("$python frame", -60, 500, 3)]
  s = overhead.trace_summary(meta + work + derived + host, 2, device=True)
  assert s["kernels_per_step"] == 7 / 2
  assert s["transfers_per_step"] == 1 / 2
  assert s["kernel_us_per_step"] == (10 + 10 + 4 + 10 + 4 + 2 + 2) / 2
  # Union: [0, 15) + [30, 34) + [100, 110) + [120, 122) + [130, 134)
  # + [140, 143).
  assert s["busy_us_per_step"] == (15 + 4 + 10 + 2 + 4 + 3) / 2
  assert s["dispatch_us_per_call"] == 20.0  # the median
  assert s["by_kind_us"] == {
    "multiply_fusion": 15.0,
    "dot": 4.0,
    "loop_add_fusion": 2.0,
    "MemcpyD2H": 1.0,
  }
  assert s["lines"] == ["Stream #7", "Stream #8"]
  # A trace that lacks what it must have is refused, naming what it has.
  no_device = [e for e in meta if e["pid"] == 1] + host
  with pytest.raises(ValueError, match=r"no device kernels.*'/host:CPU'"):
    overhead.trace_summary(no_device, 2, device=True)
  with pytest.raises(ValueError, match="no PjitFunction spans"):
    overhead.trace_summary(meta + work, 2, device=True)


def test_trace_summary_counts_a_cpu_conditional_through_its_kernels():
  # XLA:CPU has no device process: its thunks carry an hlo_op, and a
  # conditional's span holds the kernels of the branch it ran.
  events = [
    _span("a", 0, 5, 1, hlo_op="fusion.1"),
    _span("end: a", 5, 0.1, 1),  # as XLA:CPU writes them: no hlo_op
    _span("cond", 10, 20, 1, hlo_op="conditional"),
    _span("b", 11, 8, 1, hlo_op="fusion.2"),
    _span("c", 20, 9, 1, hlo_op="add.4"),
    _span("d", 12, 3, 2, hlo_op="fusion.5"),  # the other core, at once
    _span("PjitFunction(ours)", -9, 4, 3),
  ]
  s = overhead.trace_summary(events, 1, device=False)
  assert s["kernels_per_step"] == 4  # a, b, c, d; not the conditional
  assert s["by_kind_us"] == {"add": 9, "fusion": 16}
  assert s["busy_us_per_step"] == 5 + (19 - 11) + (29 - 20)


# A module as XLA:GPU compiles one: a Triton GEMM fusion (its dot in a
# nested fusion), a cuBLAS GEMM and cuDNN's attention as custom calls, a
# reduction and an elementwise fusion, a copy; op_names as JAX writes them.
GPU_HLO = """HloModule jit_step

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%nested_dot (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_fusion_dot.3_computation (p0.1: bf16[64,32], p1.1: bf16[32,16]) -> bf16[64,16] {
  %p0.1 = bf16[64,32]{1,0} parameter(0)
  %p1.1 = bf16[32,16]{1,0} parameter(1)
  ROOT %fusion.7 = bf16[64,16]{1,0} fusion(%p0.1, %p1.1), kind=kCustom, calls=%nested_dot
}

%fused_reduce.2 (p0.2: f32[64,16]) -> f32[64] {
  %p0.2 = f32[64,16]{1,0} parameter(0)
  %c = f32[] constant(0)
  ROOT %reduce.3 = f32[64]{0} reduce(%p0.2, %c), dimensions={1}, to_apply=%add
}

%fused_multiply (p0.3: f32[64,16]) -> f32[64,16] {
  %p0.3 = f32[64,16]{1,0} parameter(0)
  ROOT %multiply.4 = f32[64,16]{1,0} multiply(%p0.3, %p0.3)
}

%fused_multiply.1 (p0.4: f32[64,16]) -> f32[64,16] {
  %p0.4 = f32[64,16]{1,0} parameter(0)
  ROOT %multiply.5 = f32[64,16]{1,0} multiply(%p0.4, %p0.4)
}

%fused_add (p0.5: f32[64,16]) -> f32[64,16] {
  %p0.5 = f32[64,16]{1,0} parameter(0)
  ROOT %add.6 = f32[64,16]{1,0} add(%p0.5, %p0.5)
}

%cublas_wrapped (p0.7: bf16[64,32], p1.7: bf16[32,16]) -> f32[64,16] {
  %p0.7 = bf16[64,32]{1,0} parameter(0)
  %p1.7 = bf16[32,16]{1,0} parameter(1)
  ROOT %custom-call.10 = f32[64,16]{1,0} custom-call(%p0.7, %p1.7), custom_call_target="__cublas$lt$matmul"
}

%graph (p0.6: f32[64,16]) -> f32[64,16] {
  %p0.6 = f32[64,16]{1,0} parameter(0)
  ROOT %loop_add_fusion.9.clone = f32[64,16]{1,0} fusion(%p0.6), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/jvp(GPT)/block2/out/add"}
}

ENTRY %main.9 (x: bf16[64,32], w: bf16[32,16], g: f32[64,16], q: bf16[2,8,2,4]) -> (bf16[64,16], f32[64]) {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %g = f32[64,16]{1,0} parameter(2)
  %q = bf16[2,8,2,4]{3,2,1,0} parameter(3)
  %gemm_fusion_dot.3 = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.3_computation, metadata={op_name="jit(step)/jvp(GPT)/block3/attn/qkv/dot_general"}
  %custom-call.4 = (f32[64,16]{1,0}, s8[1024]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(GPT))/block7/jvp(GPT)/block7/checkpoint/block7._fc_gelu/fc/dot_general"}
  %attention.5 = (bf16[2,8,2,4]{3,2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/jvp(GPT)/block0/attn/dot_product_attention_fwd"}
  %input_reduce_fusion.2 = f32[64]{0} fusion(%g), kind=kInput, calls=%fused_reduce.2, metadata={op_name="jit(step)/transpose(jvp(GPT))/block1/LayerNorm_0/reduce_sum"}
  %loop_multiply_fusion = f32[64,16]{1,0} fusion(%g), kind=kLoop, calls=%fused_multiply, metadata={op_name="jit(step)/cond/branch_1_fun/mul"}
  %loop_multiply_fusion.1 = f32[64,16]{1,0} fusion(%g), kind=kLoop, calls=%fused_multiply.1, metadata={op_name="jit(step)/jvp(GPT)/block4/mul"}
  %command_buffer.1 = f32[64,16]{1,0} call(%g), to_apply=%graph
  %address_computation.11 = f32[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%cublas_wrapped, metadata={op_name="jit(step)/jvp(GPT)/block5/out/dot_general"}
  %norm.12 = (f32[64,16]{1,0}, u8[0]{0}) custom-call(%g), custom_call_target="__cudnn$norm", metadata={op_name="jit(step)/jvp(GPT)/block6/LayerNorm_0/norm"}
  %copy.6 = f32[64,16]{0,1} copy(%g)
  ROOT %tuple.8 = (bf16[64,16]{1,0}, f32[64]{0}) tuple(%gemm_fusion_dot.3, %input_reduce_fusion.2)
}
"""


def test_device_time_reads_a_gpu_trace_against_its_hlo():
  # As a GPU's trace shows a step: inside a CUDA graph every kernel's hlo_op
  # names the graph's call, XLA's own kernels bear their fusion's name (its
  # '.' and '-' as '_'; two fusions of one body run as the first's kernel),
  # cuBLAS's and cuDNN's their library's; one cuBLAS GEMM launched outside
  # the graph names its custom call.
  meta = [
    dict(ph="M", name="process_name", pid=2, args={"name": "/device:GPU:0"}),
    dict(ph="M", name="thread_name", pid=2, tid=7, args={"name": "Stream #7"}),
  ]
  graph = {"hlo_op": "command_buffer_1"}  # as an H200's trace names it
  step = [  # (name, us, args)
    ("gemm_fusion_dot_3", 10, graph),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 12, graph),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", 8, graph),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma", 7, graph),
    ("input_reduce_fusion_2", 3, graph),
    ("loop_multiply_fusion", 2, graph),  # loop_multiply_fusion's body
    ("loop_multiply_fusion", 2, graph),  # and loop_multiply_fusion.1's
    ("loop_add_fusion_9_clone", 6, graph),
    ("Memset 0", 1, graph),
    ("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize64x256", 5, {"hlo_op": "custom-call.4"}),
    # Were the graph's call named so in the HLO, its kernels stay their own.
    ("some_kernel_7", 4, {"hlo_op": "command_buffer.1"}),
    ("address_computation_11", 9, graph),  # a fusion around cuBLAS
    ("cudnn_norm_kernel", 2, {"hlo_op": "norm.12"}),
  ]  # fmt: skip
  work, ts = [], 0
  for _ in range(2):  # two steps, back to back
    for name, us, args in step:
      work.append(_span(name, ts, us, 7, pid=2, **args))
      ts += us
  s = device_time.summary(meta + work, GPU_HLO, 2, device=True)
  assert s["by_class_us"] == {
    "matmul": 10 + 12 + 8 + 5 + 9,
    "attention": 7,
    "reduction": 3 + 2,
    "elementwise": 2 + 2 + 6,
    "copy": 1,
    "other": 4,
  }
  assert s["by_label_us"] == {
    "matmul (library kernels)": 12 + 8,
    "fwd attn/qkv/dot_general": 10,
    "fwd block*/out/dot_general": 9,
    "attention (library kernels)": 7,
    "fwd block*/out/add": 6,
    "bwd block*._fc_gelu/fc/dot_general": 5,
    "fwd|step .../mul (2 places)": 2 + 2,
    "some_kernel": 4,
    "bwd block*/LayerNorm_0/reduce_sum": 3,
    "fwd block*/LayerNorm_0/norm": 2,
    "memcpy and memset": 1,
  }
  assert s["kernels_per_step"] == 13 and s["found_in_hlo"] == 8 / 13
  assert s["kernel_us_per_step"] == s["busy_us_per_step"] == 71
  # Each kernel by name, longest first: two launches a step of the fusion
  # that two bodies share; a library's kernel for two instructions is in
  # several places.
  kernels = {k["name"]: k for k in s["kernels"]}
  assert len(kernels) == 12 and s["kernels"][0]["name"].startswith("sm90_xmma")
  # XLA's own kernels move their operands and result: f32[64,16] is 4,096
  # bytes, f32[64] 256; a kernel two fusions share moves both's bytes.
  assert kernels["loop_multiply_fusion"] == {
    "name": "loop_multiply_fusion",
    "per_step": 2,
    "us": 4,
    "class": "elementwise",
    "label": "fwd|step .../mul (2 places)",
    "mbytes": 4 * 4096 / 1e6,
    "tb_per_s": 4 * 4096 / 4e-6 / 1e12,
  }
  reduce = kernels["input_reduce_fusion_2"]
  assert reduce["mbytes"] == (4096 + 256) / 1e6
  assert reduce["tb_per_s"] == pytest.approx((4096 + 256) / 3e-6 / 1e12)
  # A library's kernel moves what the HLO does not say.
  assert "tb_per_s" not in kernels["nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN"]
  assert kernels["gemm_fusion_dot_3"]["label"] == "fwd attn/qkv/dot_general"
  assert sum(k["us"] for k in s["kernels"]) == 71
  twice = meta + work + [_span("cudnn_norm_kernel", ts, 2, 7, pid=2, **graph)]
  again = device_time.summary(twice, GPU_HLO, 2, device=True)
  (norm,) = [k for k in again["kernels"] if k["name"] == "cudnn_norm_kernel"]
  assert norm["label"] == "(several)" and norm["per_step"] == 1.5
  # The longest labels kept, the rest summed.
  short = device_time.summary(meta + work, GPU_HLO, 2, device=True, top=2)
  assert short["by_label_us"] == {
    "matmul (library kernels)": 20,
    "fwd attn/qkv/dot_general": 10,
    "other labels": 71 - 30,
  }
  with pytest.raises(ValueError, match="no device kernels.*Stream #7"):
    device_time.summary(meta, GPU_HLO, 2, device=True)
  # XLA:CPU runs a small call as one thunk that names it: classed by what it
  # calls (here an add's fusion).
  call = _span("command_buffer.1", 0, 5, 1, hlo_op="command_buffer.1")
  cpu = device_time.summary([call], GPU_HLO, 1, device=False)
  assert cpu["by_class_us"]["elementwise"] == 5 and cpu["found_in_hlo"] == 1


LOOP_HLO = """HloModule jit_loop

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%body (p: f32[8,8]) -> f32[8,8] {
  %p = f32[8,8]{1,0} parameter(0)
  ROOT %dot.2 = f32[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%cond (p.1: f32[8,8]) -> pred[] {
  %p.1 = f32[8,8]{1,0} parameter(0)
  ROOT %t = pred[] constant(true)
}

%sums (p.2: f32[8,8]) -> f32[8,8] {
  %p.2 = f32[8,8]{1,0} parameter(0)
  %z = f32[] constant(0)
  %r = f32[8]{0} reduce(%p.2, %z), dimensions={1}, to_apply=%add
  ROOT %b.3 = f32[8,8]{1,0} broadcast(%r), dimensions={0}
}

%same (p.3: f32[8,8]) -> f32[8,8] {
  ROOT %p.3 = f32[8,8]{1,0} parameter(0)
}

ENTRY %main (x: f32[8,8], i: s32[]) -> f32[8,8] {
  %x = f32[8,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %while.4 = f32[8,8]{1,0} while(%x), condition=%cond, body=%body
  ROOT %conditional.5 = f32[8,8]{1,0} conditional(%i, %while.4, %while.4), branch_computations={%same, %sums}
}
"""


def test_loops_and_conditionals_are_classed_by_what_they_run():
  # A loop by its body and condition, a conditional by its branches: the
  # computations overhead.kernel_lines walks for their kernels.
  _, _, holders = device_time.hlo_index(LOOP_HLO)
  assert holders["while.4"][0] == "matmul"
  assert holders["conditional.5"][0] == "reduction"


def test_merged_label_keeps_what_the_fusions_share():
  merged = device_time.merged_label
  assert merged(["fwd a/b", "fwd a/b"]) == "fwd a/b"
  assert merged(
    ["fwd block*/LayerNorm_0/rsqrt", "fwd block*/LayerNorm_1/rsqrt"]
  ) == ("fwd block*/LayerNorm_*/rsqrt")
  assert merged(["fwd block*/LayerNorm_0/rsqrt", "fwd ln_f/rsqrt"]) == (
    "fwd .../rsqrt (2 places)"
  )
  assert merged(["fwd x/a_1/add", "fwd x/b_2/add"]) == "fwd x/*/add"
  assert merged(["bwd x/add", "fwd x/add"]) == "bwd|fwd x/add"
  # A label without metadata is a name, in no pass.
  assert merged(["wrapped_convert", "fwd x/convert"]) == "fwd, 2 places"
  assert merged(["bwd x/add", "fwd y/mul", "fwd y/mul"]) == "bwd|fwd, 2 places"


def test_device_time_reads_a_torch_gpu_trace_by_kernel_names():
  # torch.profiler's Chrome trace of a compiled nanoGPT step on a GPU:
  # Inductor's Triton kernels, cuBLAS, flash attention, the fused AdamW and
  # GradScaler's kernels, a memset; the CPU's ops beside them do not count.
  names = {  # name -> (us, class)
    "triton_per_fused_native_layer_norm_3": (4, "reduction"),
    "triton_red_fused_sum_12": (1, "reduction"),
    "triton_poi_fused_add_gelu_7": (6, "elementwise"),
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": (20, "matmul"),
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN": (10, "matmul"),
    # Inductor's prefixes say what a kernel is, whatever ops it fused.
    "triton_poi_fused__scaled_dot_product_flash_attention_transpose_3": (2, "elementwise"),
    "triton_poi_fused_native_layer_norm_backward_7": (1, "elementwise"),
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>(Params)": (9, "attention"),
    "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>": (5, "elementwise"),
    "void at::native::_amp_non_finite_check_and_unscale_cuda_": (2, "reduction"),
    "some_library_kernel": (3, "other"),
  }  # fmt: skip
  events, ts = [], 0
  for _ in range(2):  # two steps
    for name, (us, _) in names.items():
      events.append(dict(_span(name, ts, us, 7, pid=0), cat="kernel"))
      ts += us
    memset = _span("Memset (Device)", ts, 1, 7, pid=0)
    events.append(dict(memset, cat="gpu_memset"))
    events.append(dict(_span("aten::mm", ts, 50, 1, pid=9), cat="cpu_op"))
    ts += 1
  s = device_time.torch_summary(events, 2, device=True)
  want = dict.fromkeys(device_time.CLASSES, 0)
  for us, cls in names.values():
    want[cls] += us
  want["copy"] += 1
  assert s["by_class_us"] == want
  assert s["kernel_us_per_step"] == s["busy_us_per_step"] == 64
  assert s["by_label_us"]["triton_per_fused_native_layer_norm"] == 4
  assert s["found_in_hlo"] is None and s["kernels_per_step"] == 12
  # Kernels that overlap ran side by side: each keeps its whole time.
  side = [dict(e, ts=0) for e in events if e["cat"] == "kernel"][:2]
  assert (
    device_time.torch_summary(side, 1, device=True)["kernel_us_per_step"]
    == 4 + 1
  )
  with pytest.raises(ValueError, match="no kernels.*cpu_op"):
    device_time.torch_summary(events[-1:], 1, device=True)


def test_span_runs_from_the_first_kernel_to_the_last():
  # Three kernels, a 5 us gap between the first two and the last two
  # overlapping: busy 10 + 15 us, span 30 us, for 2 steps.
  events = [
    dict(_span(name, ts, us, 7, pid=0), cat="kernel")
    for name, ts, us in (("a", 0, 10), ("b", 15, 5), ("c", 18, 12))
  ]
  assert device_time.span_us(events) == 30
  s = device_time.torch_summary(events, 2, device=True)
  assert s["busy_us_per_step"] == 12.5 and s["span_us_per_step"] == 15


def test_gpt2_profile_table_splits_idle_time_and_gives_mfu_back_to_back():
  def profile(**us):
    p = dict(by_class_us=dict.fromkeys(device_time.CLASSES, 0.0))
    p["by_class_us"]["matmul"] = 20_000.0
    return p | dict(by_label_us={}, found_in_hlo=None) | us

  run = {
    "model": "GPT",
    "batch": 16,
    "device": "H100",
    "jax": "0.10.2",
    "steps_per_round": 5,
    "trace_dir": "t",
    "peak_bf16_tflops": 1000.0,
    "flops_per_step": 1.6e13,
    "profiles": {
      "now": profile(
        wall_us_per_step=40_000,
        span_us_per_step=32_000,
        busy_us_per_step=30_000,
      ),
      "before": profile(wall_us_per_step=40_000, busy_us_per_step=30_000),
    },
  }
  text = gpt2.profile_table({"r": run})
  # 16 TFLOP in 32 ms: 500 TFLOP/s, half the peak; 2 ms of gaps between
  # kernels, 8 ms of waiting at the round's ends; 800 TFLOP/s in matmuls.
  assert "| now | 40.00 | 32.00 | 50.0% | 30.00 | 20.00 |" in text
  assert "| 0.00 | 2.00 | 8.00 | 800.0 | n/a |" in text
  # A profile saved before spans were: its idle time in one figure.
  assert "| before | 40.00 | n/a | n/a | 30.00 |" in text
  assert "| 10.00 in all | n/a | 800.0 |" in text


def test_self_times_take_each_span_less_what_it_holds():
  spans = [
    _span("linear", 0, 10, 1),
    _span("t", 1, 2, 1),
    _span("addmm", 3, 6, 1),
    _span("gemm", 4, 4, 1),  # inside addmm, inside linear
    _span("add", 12, 3, 1),  # after them
    _span("same", 12, 3, 1),  # the same interval: what add called
    _span("other thread", 2, 5, 2),
  ]
  own = {e["name"]: us for e, us in device_time.self_times(spans)}
  assert own == {
    "linear": 10 - 2 - 6,
    "t": 2,
    "addmm": 6 - 4,
    "gemm": 4,
    "add": 3 - 3,
    "same": 3,
    "other thread": 5,
  }


def test_device_time_labels_say_where_in_the_model():
  wrapped = "jvp(_Wrapped)/_Wrapped._run/_Wrapped.body/module"
  cases = {
    "jit(step)/transpose(jvp(cross_entropy))/convert_element_type": (
      "bwd cross_entropy/convert_element_type"
    ),
    f"jit(step)/transpose({wrapped})/block3/{wrapped}/block3/checkpoint"
    "/block3._fc_gelu/fc/reduce_sum": "bwd block*._fc_gelu/fc/reduce_sum",
    f"jit(step)/{wrapped}/block11/LayerNorm_0/jmp_train_policy_override"
    "/reduce_sum": "fwd block*/LayerNorm_0/reduce_sum",
    "jit(step)/jvp()/jit(_take)/gather": "fwd gather",
    "jit(step)/add": "step add",
  }
  for op_name, want in cases.items():
    line = f'%f.1 = f32[2] fusion(%p), metadata={{op_name="{op_name}"}}'
    assert device_time.label("f.1", line) == want, op_name
  assert device_time.label("loop_add_fusion.3", "%x = f32[2] add()") == (
    "loop_add_fusion"
  )


def test_innermost_drops_only_spans_that_hold_another():
  def kept(*spans):
    events = [_span(n, ts, dur, 1) for n, ts, dur in spans]
    return sorted(e["name"] for e in overhead.innermost(events))

  assert kept(("cond", 0, 10), ("k", 2, 3)) == ["k"]
  assert kept(("cond", 0, 10), ("k", 0, 3)) == ["k"]  # at its start
  assert kept(("cond", 0, 10), ("k", 7, 3)) == ["k"]  # at its end
  # Overlapping, or no longer than each other: both are kernels.
  assert kept(("k1", 0, 10), ("k2", 5, 10)) == ["k1", "k2"]
  assert kept(("k1", 0, 10), ("k2", 0, 10)) == ["k1", "k2"]
  assert kept(("zero", 0, 0), ("k", 0, 10)) == ["k", "zero"]
  # 1.1 + 2.2 > 3.3 in floats: back to back, not nested.
  assert kept(("k1", 1.1, 2.2), ("k2", 3.3, 1)) == ["k1", "k2"]


def test_overhead_profile_counts_the_compiled_kernels(tmp_path):
  # A real CPU trace: each step's kernels are its compiled HLO's
  # (count_kernels, read from the HLO text, not from the trace), the
  # conditional's update branch on these finite steps.
  tiny = ["--dims", "16,32,4", "--batch", "8", "--warmup", "1"]
  prof = overhead.main(
    [*tiny, "--profile", str(tmp_path), "--profile-steps", "4"]
    + ["--steps-per-round", "2"]
  )
  counted = overhead.main([*tiny, "--kernels"])["kernels"]
  assert set(prof["profiles"]) == set(counted)
  for name, p in prof["profiles"].items():
    assert p["steps"] == 4
    assert p["kernels_per_step"] == counted[name]["total"], name
    assert 0 < p["busy_us_per_step"] < p["wall_us_per_step"]
    assert p["dispatch_us_per_call"] > 0 and p["unprofiled_us_per_step"] > 0
    assert (tmp_path / name).is_dir()  # the trace stays for a closer look
  text = overhead.profile_table({"p": prof})
  assert "| cpu, train step, batch 8, 2 steps per wait | ours |" in text
  assert (
    "ours / plain: unprofiled " in text
    and "Ours over plain, us per step: " in text
  )
  assert "Ours over skip-only, us per step: " in text


def test_overhead_steps_per_round_label_and_gpu_verdicts(capsys):
  result = overhead.main(
    ["--dims", "16,32,4", "--batch", "8", "--steps", "2", "--warmup", "1"]
    + ["--steps-per-round", "3"]
  )
  assert result["steps_per_round"] == 3
  assert "| full step, batch 8, 3 steps per wait |" in overhead.table(
    {"r": result}
  )
  # On a GPU each full-step row gets its own verdict against 1.02x.
  gpu = {"device": "NVIDIA H100, 1 device(s), x86_64"}
  rows = {
    "a": dict(result, **gpu, steps_per_round=1),
    "b": dict(result, **gpu, steps_per_round=10),
  }
  rows["a"]["ratio_vs_plain"] = dict(result["ratio_vs_plain"], ours=1.05)
  rows["b"]["ratio_vs_plain"] = dict(result["ratio_vs_plain"], ours=1.01)
  text = overhead.gpu_table(rows)
  assert (
    "1.050x waiting after every step, **not met**;"
    " 1.010x with 10 steps per wait, **met**"
  ) in text
  for argv, message in (
    (
      ["--steps-per-round", "0"],
      "argument --steps-per-round: must be >= 1, got 0",
    ),
    (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (
      ["--profile-steps", "-1"],
      "argument --profile-steps: must be >= 1, got -1",
    ),
    (["--profile", "d", "--kernels"], "--profile and --kernels"),
    (
      ["--target", "h100"],
      "--target h100 compiles without running: add --kernels",
    ),
    (["--kernels", "--target", "a100"], "invalid choice: 'a100'"),
    (
      ["--profile", "d", "--profile-steps", "5", "--steps-per-round", "2"],
      "--profile-steps 5 must be a multiple of --steps-per-round 2",
    ),
  ):
    with pytest.raises(SystemExit):
      overhead.parse_args(argv)
    assert message in capsys.readouterr().err


def test_suite_runs_only_the_named_jobs_in_order_and_archives(
  tmp_path, capsys, monkeypatch
):
  import tarfile

  import jax

  # Asked in a child process; this one's first device says what it must be.
  assert (suite.gpu_kind() is None) == (jax.devices()[0].platform != "gpu")
  monkeypatch.setattr(suite, "gpu_kind", lambda: None)  # the CPU jobs
  for only, message in (
    ("overhead-64,overhed-update", "--only names overhed-update, not jobs"),
    (",", "--only ',' names no job"),
  ):
    with pytest.raises(SystemExit):  # a typo is refused, not skipped
      suite.main(["--quick", "--only", only])
    assert message in capsys.readouterr().err
  json_dir, tgz = tmp_path / "results", tmp_path / "r.tgz"
  argv = [
    "--quick",
    "--json-dir",
    str(json_dir),
    "--out",
    str(tmp_path / "B.md"),
  ]
  with pytest.raises(SystemExit):
    suite.main([*argv, "--archive", str(tmp_path / "no" / "r.tgz")])
  assert "its folder does not exist" in capsys.readouterr().err

  def archived():
    with tarfile.open(tgz) as tar:
      return sorted(tar.getnames())

  # A trace an earlier call left on a warm machine: not archived again. An
  # earlier result outside traces/ still is.
  old = json_dir / "traces" / "earlier" / "perfetto_trace.json.gz"
  old.parent.mkdir(parents=True)
  old.write_bytes(b"old")
  (json_dir / "earlier.json").write_text(json.dumps({"ran": "earlier"}))
  for path in (old, json_dir / "earlier.json"):
    os.utime(path, (time.time() - 60, time.time() - 60))
  seen = []

  def run_job(name, job, where, timeout=None):
    if seen:  # the first job's results were archived before this one ran
      assert archived() == [
        "results",
        "results/earlier.json",
        "results/environment.json",
        "results/overhead-update.json",
        "results/traces",
        "results/traces/earlier",
        "results/traces/overhead-update.json.gz",
      ]
    seen.append(name)
    (where / f"{name}.json").write_text(json.dumps({"ran": name}))
    (where / "traces").mkdir(exist_ok=True)
    (where / "traces" / "t.xplane.pb").write_bytes(b"raw")
    (where / "traces" / f"{name}.json.gz").write_bytes(b"new")
    if name == "overhead-update":
      raise RuntimeError("overhead-update failed (exit 1)")
    return 0.0

  monkeypatch.setattr(suite, "run_job", run_job)
  monkeypatch.setattr(suite, "render", lambda *a: "page")
  with pytest.raises(SystemExit, match="failed: overhead-update"):
    suite.main(
      [*argv, "--only", "overhead-update,overhead-64", "--archive", str(tgz)]
    )
  assert seen == ["overhead-update", "overhead-64"]
  assert archived() == [  # the raw profiler files and old traces left out
    "results",
    "results/earlier.json",
    "results/environment.json",
    "results/overhead-64.json",
    "results/overhead-update.json",
    "results/traces",
    "results/traces/earlier",
    "results/traces/overhead-64.json.gz",
    "results/traces/overhead-update.json.gz",
  ]


def test_memory_table_refuses_checks_that_cannot_compile():
  """A batch that does not split over data x accum, and bfloat16 params on
  a mesh with a model axis (XLA:CPU aborts: README, Limits), are refused
  before anything compiles; the table alone is still given."""
  refused = [
    (["--mesh", "data=8", "--accum-steps", "2", "--check"], "multiple of 16"),
    (
      ["--preset", "bf16-true", "--mesh", "data=4,model=2", "--check"],
      "aborts the XLA:CPU compiler",
    ),
    (["--accum-steps", "0"], "--accum-steps must be 1 or more"),
  ]
  for argv, why in refused:
    with pytest.raises(SystemExit, match=why):
      memory_table.parse_args(argv)
  args = memory_table.parse_args(
    ["--preset", "bf16-true", "--mesh", "data=4,model=2"]
  )
  assert args.axes == {"data": 4, "model": 2}


# A job that starts a child of its own (as torch.compile's workers are) and
# writes the child's pid where the job's JSON goes, then sleeps.
SLEEPER = [
  "-c",
  "import subprocess, sys, time, pathlib;"
  " c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
  " pathlib.Path(sys.argv[2]).write_text(str(c.pid)); time.sleep(60)",
]


def assert_gone(pid):
  for _ in range(50):  # reaped by init once its parent is gone
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return
    time.sleep(0.1)
  os.kill(pid, 9)
  raise AssertionError("the job's child outlived the suite's kill")


def test_suite_kills_the_running_job_when_it_is_terminated(tmp_path):
  # A time limit's SIGTERM to the suite reaches the job and its children,
  # which run in a process group of their own.
  import signal
  import threading

  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signal handlers are set from the main thread only")
  previous = signal.signal(signal.SIGTERM, suite._exit_on_sigterm)
  timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM))
  try:
    timer.start()
    with pytest.raises(SystemExit) as stopped:
      suite.run_job("sleepy", SLEEPER, tmp_path)
  finally:
    timer.cancel()
    signal.signal(signal.SIGTERM, previous)
  assert stopped.value.code == 128 + signal.SIGTERM
  assert_gone(int((tmp_path / "sleepy.json").read_text()))


def test_suite_kills_a_job_past_its_timeout_and_stops_at_the_deadline(
  tmp_path, capsys, monkeypatch
):
  # A lent GPU's session is minutes long: a job that hangs is killed and the
  # others run; past the deadline no job starts, and the run says which.
  t0 = time.monotonic()
  with pytest.raises(RuntimeError, match="sleepy timed out after 2s"):
    suite.run_job("sleepy", SLEEPER, tmp_path, timeout=2)
  assert time.monotonic() - t0 < 30
  assert_gone(int((tmp_path / "sleepy.json").read_text()))
  monkeypatch.setattr(suite, "gpu_kind", lambda: None)
  monkeypatch.setattr(suite, "environment", lambda gpu: {})
  monkeypatch.setattr(suite, "render", lambda *a: "page")
  ran = []

  def run_job(name, job, where, timeout=None):
    ran.append((name, timeout))
    (where / f"{name}.json").write_text('{"rows": [1, 2')  # killed mid-write
    time.sleep(0.7)
    raise RuntimeError(f"{name} timed out after {timeout:g}s")

  monkeypatch.setattr(suite, "run_job", run_job)
  argv = ["--json-dir", str(tmp_path), "--out", str(tmp_path / "B.md")]
  only = ["--only", "overhead-64,overhead-update,host-cost"]
  with pytest.raises(SystemExit, match="failed: overhead-64, overhead-update,"):
    suite.main([*argv, *only, "--deadline", "0.5", "--job-timeout", "9"])
  assert ran == [("overhead-64", 9.0)]
  out = capsys.readouterr().out
  assert "== host-cost: not started, past --deadline 0.5s" in out
  # The half-written JSON is gone, so the page still renders.
  assert "overhead-64.json: half written when its job stopped, removed" in out
  assert not (tmp_path / "overhead-64.json").exists()
  for flag in ("--deadline", "--job-timeout"):
    for bad in ("0", "-1", "nan"):
      with pytest.raises(SystemExit):
        suite.main([*argv, flag, bad])
      assert f"{flag} must be a positive number of seconds" in (
        capsys.readouterr().err
      )


def test_every_suite_command_in_the_docs_names_jobs_that_exist():
  # The README's command for the next GPU session is copied into a lent
  # GPU's few minutes: a misspelled job there fails only then.
  root = pathlib.Path(suite.__file__).resolve().parents[1]
  known = set(suite.CPU_JOBS) | set(suite.GPU_JOBS)
  found = 0
  for doc in (root / "README.md", root / "benchmarks" / "page.md"):
    for command in re.findall(
      r"suite\.py[^`]*?--only[ =]([\w,\-]+)", doc.read_text()
    ):
      names = set(command.split(","))
      assert names <= known, (doc.name, names - known)
      # One machine's jobs: the suite refuses the other's on either.
      assert names <= set(suite.CPU_JOBS) or names <= set(suite.GPU_JOBS)
      found += 1
  assert found >= 5


def test_gpu_tables_name_each_rows_device_when_two_gpus_made_them():
  def run(device, batch, ms):
    rows = [
      dict(
        step=step, ms=ms * k, steps_per_s=1.0, tokens_per_s=int(1e6 / ms / k)
      )
      | dict(tflops=1.0, mfu=0.4 / k, ratio_vs_plain=k)
      for step, k in (("hand-bf16", 1.0), ("bf16-mixed", 1.25))
    ]
    return dict(
      model="GPT",
      device=device,
      peak_bf16_tflops=989.4,
      batch=batch,
      steps_per_round=5,
      rows=rows,
    )

  one = {"a": run("NVIDIA H200, x86_64", 16, 30.0)}
  text = gpt2.table(one)
  assert "| device |" not in text and "on NVIDIA H200, x86_64;" in text
  two = one | {"b": run("NVIDIA H100 80GB HBM3, x86_64", 32, 70.0)}
  text = gpt2.table(two)
  assert "on NVIDIA H100 80GB HBM3 and NVIDIA H200, x86_64;" in text
  assert "| bf16-mixed | NVIDIA H200 | 16 |" in text
  assert "| hand-bf16 | NVIDIA H100 80GB HBM3 | 32 |" in text
  # The verdict names the device of the run it was read from.
  assert "(NVIDIA H200, batch 16, loss logits)" in text
  # Two runs of one batch, loss and flags on one device (code before and
  # after a change): the tag tells their rows apart.
  later = run("NVIDIA H200, x86_64", 16, 29.0) | {"tag": "grouped check"}
  text = gpt2.table(one | {"c": later})
  assert text.count("| bf16-mixed | 16 | 5 | logits |") == 1
  assert text.count("| bf16-mixed | 16 | 5 | logits; grouped check |") == 1
  assert gpt2.parse_args(["--tag", "grouped check"]).tag == "grouped check"


def test_gpu_overhead_sentence_reads_one_devices_rows():
  def run(device, skip, study=False):
    names = ["plain", "skip-only", "ours", "jmp-style"]
    ratios = dict(zip(names, (1.0, skip, 1.06, 1.02), strict=True))
    if study:
      ratios |= {"tiny-cond": 1.05, "select-skip": 1.004}
    return dict(
      what="full train step",
      batch=16384,
      rounds=100,
      device=device,
      median_ms={n: 4.0 * q for n, q in ratios.items()},
      ratio_vs_plain=ratios,
    )

  h200 = run("NVIDIA H200, x86_64", 1.004)
  alone = overhead.gpu_table({"a": h200})
  assert "The skip alone (skip-only) stays within 0.4% of plain" in alone
  both = overhead.gpu_table(
    {"a": h200, "b": run("NVIDIA H100, x86_64", 1.007, True)}
  )
  # The H100's --study rows (tiny-cond 5% over plain) are another machine's.
  assert "On NVIDIA H200, the skip alone (skip-only) stays within 0.4%" in both
  assert "| full step, batch 16384, NVIDIA H100 (`--study`) |" in both
  assert "1.060x waiting after every step on NVIDIA H200" in both

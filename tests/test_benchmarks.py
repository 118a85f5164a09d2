"""The benchmarks run on tiny configs, and BENCHMARKS.md is the suite's output."""

import json
import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(relpath):
  return runpy.run_path(str(ROOT / relpath), run_name="not_main")


def test_benchmarks_md_is_the_suite_rendering_of_the_saved_results(tmp_path):
  suite = load("benchmarks/suite.py")
  out = tmp_path / "BENCHMARKS.md"
  results = suite["main"](
    [
      "--render",
      "--json-dir",
      str(ROOT / "benchmarks" / "results"),
      "--out",
      str(out),
    ]
  )
  assert out.read_text() == (ROOT / "BENCHMARKS.md").read_text()
  for job in ("overhead-64", "overhead-1024", "compile", "zero1", "fp8", "gpt"):
    assert job in results
  page = out.read_text()
  for heading in (
    "Step-time overhead",
    "Compile time",
    "ZeRO-1",
    "FP8",
    "GPT-2",
  ):
    assert f"## {heading}" in page


def test_gpu_results_render_beside_cpu_ones():
  suite = load("benchmarks/suite.py")
  results = {
    p.stem: json.loads(p.read_text())
    for p in (ROOT / "benchmarks" / "results").glob("*.json")
  }
  env = results.pop("environment")
  gpu_env = results.pop("environment-gpu", None) or dict(
    env, gpu="H100", note=""
  )
  gpu_jobs = set(suite["jobs"](False, True))
  assert gpu_jobs.isdisjoint(suite["jobs"](False, False))
  cpu_only = {k: v for k, v in results.items() if k not in gpu_jobs}
  without = suite["render"](cpu_only, env, None, False)
  assert "none lent" in without and "### On a GPU" not in without
  if not gpu_jobs <= set(results):
    return  # no GPU results saved: the rest needs them
  page = suite["render"](results, env, gpu_env, False)
  assert "### On a GPU" in page and "GPU machine: " + gpu_env["gpu"] in page
  (mixed,) = [r for r in results["gpt2"]["rows"] if r["step"] == "bf16-mixed"]
  mfu = mixed["mfu"]
  assert f"{100 * mfu:.1f}%" in page


def test_overhead_benchmark_runs(capsys):
  main = load("benchmarks/overhead.py")["main"]
  result = main(
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
  masters = main(
    ["--dims", "16,32,4", "--steps", "2", "--warmup", "1"]
    + ["--update-only", "--bf16-params"]
  )
  assert set(masters["ratio_vs_hand-masters"]) == {"hand-masters", "ours"}
  assert masters["param_dtype"] == "bfloat16"


def test_fp8_benchmark_runs(capsys):
  main = load("benchmarks/fp8.py")["main"]
  result = main(["--matmul", "--sizes", "64", "--rounds", "2", "--warmup", "1"])
  (row,) = result["matmul"]
  assert row["n"] == 64 and row["bf16_ms"] > 0 and row["fp8_ms"] > 0
  assert "| 64 |" in capsys.readouterr().out


def test_compile_time_benchmark_runs_and_renders(tmp_path):
  result = load("benchmarks/compile_time.py")["main"](
    [
      *("--layers", "1", "--d-model", "16", "--heads", "2", "--seq", "8"),
      *("--batch", "2", "--rounds", "1", "--json", str(tmp_path / "c.json")),
      *("--only", "plain,hand-fp16,ours-fp16"),
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
  section = "\n".join(
    load("benchmarks/suite.py")["_compile"]({"compile": saved})
  )
  assert "| ours-fp16 |" in section and "Goal: at most 1.2x" in section


def test_gpt2_benchmark_tiny_runs(capsys):
  result = load("benchmarks/gpt2.py")["main"](
    [
      *("--tiny", "--presets", "bf16-mixed", "--batch", "2", "--rounds", "1"),
      *("--steps-per-round", "1", "--warmup", "1"),
    ]
  )
  assert [r["step"] for r in result["rows"]] == [
    "plain",
    "hand-bf16",
    "bf16-mixed",
  ]
  for row in result["rows"]:
    assert row["tokens_per_s"] > 0 and row["mfu"] is None  # CPU: no peak
  assert "| bf16-mixed |" in capsys.readouterr().out


def test_suite_collects_the_gpt_example_metrics(tmp_path, monkeypatch):
  # The GPT job writes its own metrics files under --out; the suite must find
  # them there and save one JSON without the per-step history.
  suite = load("benchmarks/suite.py")
  calls = []

  class FakeSubprocess:
    @staticmethod
    def run(cmd, **kwargs):
      calls.append(cmd)
      out = pathlib.Path(cmd[cmd.index("--out") + 1]) / "gpt-compare"
      out.mkdir(parents=True, exist_ok=True)
      for preset in suite["GPT_PRESETS"].split(","):
        metrics = {"preset": preset, "history": [1, 2], "final_val_loss": 1.9}
        (out / f"metrics-{preset}.json").write_text(json.dumps(metrics))
      return type("Done", (), {"returncode": 0})()

  monkeypatch.setitem(
    suite["run_job"].__globals__, "subprocess", FakeSubprocess
  )
  monkeypatch.setitem(suite["run_job"].__globals__, "ROOT", tmp_path)
  suite["run_job"]("gpt", ["examples/gpt.py", "--compare", "x"], tmp_path)
  saved = json.loads((tmp_path / "gpt.json").read_text())
  assert [r["preset"] for r in saved["runs"]] == suite["GPT_PRESETS"].split(",")
  assert all("history" not in r for r in saved["runs"])
  assert calls and calls[0][-2:] == [
    "--out",
    str(tmp_path / "runs" / "bench-gpt"),
  ]

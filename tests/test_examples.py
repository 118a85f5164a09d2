"""The main job and the benchmark run end to end on tiny configs."""

import json
import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(relpath):
  return runpy.run_path(str(ROOT / relpath), run_name="not_main")


@pytest.mark.parametrize("preset", ["fp16-mixed", "bf16-true"])
def test_digits_example_trains_and_writes_outputs(tmp_path, preset):
  main = load("examples/digits.py")["main"]
  summary = main(
    [
      "--preset",
      preset,
      "--max-steps",
      "40",
      "--out",
      str(tmp_path),
      "--growth-interval",
      "10",
    ]
  )
  out = tmp_path / f"digits-{preset}"
  saved = json.loads((out / "metrics.json").read_text())
  assert saved["steps"] == 40 and len(saved["history"]) == 40
  assert saved["test_accuracy"] == summary["test_accuracy"] > 0.8
  losses = [h["loss"] for h in saved["history"]]
  assert sum(losses[-5:]) < 0.3 * sum(losses[:5])
  assert (out / "curves.png").stat().st_size > 10_000
  if preset == "fp16-mixed":  # the scaler grew every 10 finite steps
    scales = [h["loss_scale"] for h in saved["history"]]
    assert max(scales) > scales[0] and saved["param_dtypes"] == ["float32"]
  else:
    assert saved["param_dtypes"] == ["bfloat16", "float32"]


def test_fp8_mlp_trains_to_within_one_point_of_bf16(tmp_path):
  main = load("examples/digits.py")["main"]
  runs = {
    preset: main(["--model", "mlp", "--preset", preset, "--out", str(tmp_path)])
    for preset in ("bf16-mixed", "bf16-fp8-mixed")
  }
  bf16, fp8 = runs["bf16-mixed"], runs["bf16-fp8-mixed"]
  assert bf16["fp8"] is None and fp8["fp8"]["format"] == "hybrid"
  assert bf16["test_accuracy"] > 0.95
  assert abs(fp8["test_accuracy"] - bf16["test_accuracy"]) <= 0.01
  # FP8 was really on: the delayed scales moved away from 1 during training.
  last = fp8["history"][-1]
  assert last["fp8_input_scale_max"] == 448.0  # inputs are in [0, 1]
  assert (
    1e5 < last["fp8_output_grad_scale_min"] < last["fp8_output_grad_scale_max"]
  )
  assert "fp8_input_scale_max" not in bf16["history"][-1]


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


def test_fp8_benchmark_runs(capsys):
  main = load("benchmarks/fp8.py")["main"]
  result = main(["--matmul", "--sizes", "64", "--rounds", "2", "--warmup", "1"])
  (row,) = result["matmul"]
  assert row["n"] == 64 and row["bf16_ms"] > 0 and row["fp8_ms"] > 0
  assert "| 64 |" in capsys.readouterr().out


def test_readme_quick_start_runs():
  readme = (ROOT / "README.md").read_text()
  start = readme.index("<!-- quick-start -->")
  code = readme[start:].split("```python\n", 1)[1].split("```", 1)[0]
  namespace = {}
  exec(compile(code, "README.md quick start", "exec"), namespace)  # noqa: S102
  assert namespace["losses"][-1] < namespace["losses"][0]


def test_gpt_example_zero1_accum_fp8_compare(tmp_path):
  main = load("examples/gpt.py")["main"]
  runs = main(
    [
      "--compare",
      "fp32,fp16-mixed",
      "--zero1",
      "--accum",
      "2",
      "--fp8",
      "--steps",
      "24",
      "--layers",
      "1",
      "--d-model",
      "32",
      "--seq-len",
      "16",
      "--batch-size",
      "16",
      "--text-bytes",
      "200000",
      "--growth-interval",
      "5",
      "--eval-every",
      "12",
      "--out",
      str(tmp_path),
    ]
  )
  out = tmp_path / "gpt-compare"
  assert (out / "curves.png").stat().st_size > 10_000
  for run in runs:
    saved = json.loads((out / f"metrics-{run['preset']}.json").read_text())
    assert saved["devices"] == 8 and saved["fp8"]["format"] == "hybrid"
    losses = [h["loss"] for h in saved["history"]]
    # From ln(128) = 4.85 nats per character (uniform) clearly down.
    assert losses[0] > 4.5 and sum(losses[-4:]) / 4 < 0.75 * losses[0]
    assert saved["evals"][-1]["val_loss"] < 0.8 * losses[0]
    assert saved["param_dtypes"] == ["float32"]
  scales = [h["loss_scale"] for h in runs[1]["history"]]
  assert max(scales) > scales[0]  # fp16-mixed: the scaler grew every 5 steps
  assert {h["loss_scale"] for h in runs[0]["history"]} == {1.0}

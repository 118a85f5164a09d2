"""examples/gpt.py end to end on a tiny config: one device, ZeRO-1, FP8."""

import json
import os
import pathlib
import subprocess
import sys

import gpt

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = [
  *("--layers", "1", "--d-model", "32", "--seq-len", "16"),
  *("--batch-size", "16", "--text-bytes", "200000"),
]


def check_trained(saved):
  losses = [h["loss"] for h in saved["history"]]
  assert len(losses) == saved["steps"]
  # From ln(128) = 4.85 nats per character (uniform) clearly down.
  assert losses[0] > 4.5 and sum(losses[-4:]) / 4 < 0.75 * losses[0]
  assert saved["evals"][-1]["val_loss"] < 0.8 * losses[0]
  scales = [h["loss_scale"] for h in saved["history"]]
  assert max(scales) > scales[0]  # the scaler grew every few finite steps


def test_gpt_example_zero1_accum_fp8(tmp_path):
  # As a user runs it: a fresh process whose 8 CPU devices come from the
  # example's own jax_num_cpu_devices, not from the test session's XLA_FLAGS.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  subprocess.run(
    [
      sys.executable,
      str(ROOT / "examples" / "gpt.py"),
      *("--preset", "fp16-mixed", "--zero1", "--accum", "2", "--fp8"),
      *("--steps", "24", *TINY, "--growth-interval", "5"),
      *("--eval-every", "12", "--out", str(tmp_path)),
    ],
    env=env,
    check=True,
    capture_output=True,
  )
  out = tmp_path / "gpt-fp16-mixed"
  saved = json.loads((out / "metrics-fp16-mixed.json").read_text())
  assert saved["devices"] == 8 and saved["fp8"]["format"] == "hybrid"
  assert saved["config"]["accum"] == 2 and saved["param_dtypes"] == ["float32"]
  check_trained(saved)
  assert [e["step"] for e in saved["evals"]] == [12, 24]
  assert (out / "curves.png").stat().st_size > 10_000
  # The comparison chart takes several runs (here this one under two names).
  other = dict(saved, preset="fp32")
  gpt.plot([other, saved], tmp_path / "compare.png", "two runs")
  assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_gpt_example_one_device_step_written_out(tmp_path):
  # The hand-written step: scaled loss, jax.grad, tx.update, apply_updates.
  (run,) = gpt.main(
    [
      *("--preset", "fp16-mixed", "--fp8", "--steps", "20", *TINY),
      *("--growth-interval", "4", "--eval-every", "10", "--out", str(tmp_path)),
    ]
  )
  saved = json.loads(
    (tmp_path / "gpt-fp16-mixed" / "metrics-fp16-mixed.json").read_text()
  )
  assert saved == json.loads(json.dumps(run))
  assert saved["devices"] == 1 and saved["fp8"]["format"] == "hybrid"
  assert saved["param_dtypes"] == ["float32"]
  check_trained(saved)


def test_gpt_text_is_the_standard_library_source():
  text = gpt.load_text(50_000)
  assert text.dtype == "uint8" and len(text) == 50_000 and text.max() < 128
  assert b"import " in text.tobytes()

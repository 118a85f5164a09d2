"""examples/gpt.py end to end on a tiny config: one device, ZeRO-1, FP8, and
ZeRO-1 as 2 processes x 4 CPU devices."""

import json
import pathlib
import subprocess
import sys
import time

import _child_env
import _mp_child
import gpt
import numpy as np
import pytest

from jmp_train import distributed, fp8

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


ZERO1_FLAGS = [
  *("--preset", "fp16-mixed", "--zero1", "--accum", "2", "--fp8"),
  *("--steps", "24", *TINY, "--growth-interval", "5", "--eval-every", "12"),
]


def test_gpt_example_zero1_accum_fp8_on_one_and_two_processes(tmp_path):
  # A fresh process whose 8 CPU devices come from the example's own
  # jax_num_cpu_devices, as when a user runs it, not from the test session's
  # XLA_FLAGS. It keeps the session's code generation flags, as the two
  # processes launched below do: their losses are compared.
  env = _child_env.child_env()
  script = str(ROOT / "examples" / "gpt.py")
  start = time.monotonic()
  subprocess.run(
    [sys.executable, script, *ZERO1_FLAGS, "--out", str(tmp_path / "one")],
    env=env,
    check=True,
    capture_output=True,
  )
  one_s = time.monotonic() - start
  out = tmp_path / "one" / "gpt-fp16-mixed"
  saved = json.loads((out / "metrics-fp16-mixed.json").read_text())
  assert saved["devices"] == 8 and saved["processes"] == 1
  # --fp8 alone: the default recipe.
  assert saved["fp8"]["recipe"] == type(fp8.DEFAULT_RECIPE).__name__
  assert saved["config"]["accum"] == 2 and saved["param_dtypes"] == ["float32"]
  check_trained(saved)
  assert [e["step"] for e in saved["evals"]] == [12, 24]
  assert (out / "curves.png").stat().st_size > 10_000
  # The comparison chart takes several runs (here this one under two names).
  other = dict(saved, preset="fp32")
  gpt.plot([other, saved], tmp_path / "compare.png", "two runs")
  assert (tmp_path / "compare.png").stat().st_size > 10_000

  # The same flags as 2 processes x 4 CPU devices: each loads its rows of
  # the same global batches, so it trains as the one process did. The time
  # limit follows the one-process run under the same load: a hang still
  # fails in minutes, a busy machine does not (60 s flat failed in CI once,
  # with process 0 done writing at 56 s).
  logs = tmp_path / "logs"
  code = distributed.launch(
    [script, *ZERO1_FLAGS, "--out", str(tmp_path / "two")],
    2,
    cpu_devices=4,
    timeout_s=_mp_child.mp_timeout_s(one_s),
    log_dir=logs,
  )
  assert code == 0, f"exit code {code}\n{_mp_child.launch_logs(logs)}"
  two = tmp_path / "two" / "gpt-fp16-mixed"
  assert sorted(p.name for p in two.iterdir()) == [
    "curves.png",
    "metrics-fp16-mixed.json",
  ]
  # Process 0 reports; process 1 prints no bar and no summary.
  first, second = (logs / f"process-{i}.log" for i in range(2))
  assert first.read_text().count("wrote ") == 1
  assert "fp16-mixed: loss" in first.read_text()
  assert "wrote " not in second.read_text()
  assert "fp16-mixed: loss" not in second.read_text()
  assert "gpt fp16-mixed" in first.read_text()  # the bar
  assert "gpt fp16-mixed" not in second.read_text()
  multi = json.loads((two / "metrics-fp16-mixed.json").read_text())
  assert multi["devices"] == 8 and multi["processes"] == 2
  check_trained(multi)
  # Only the float32 summation order of the collectives differs. FP8
  # rounding turns such a difference into a flipped E4M3 value now and then,
  # and training carries it on: the first half of the run agrees to 1e-5,
  # the rest to 2e-3 (3.4e-4 seen at worst).
  multi_losses = [h["loss"] for h in multi["history"]]
  losses = [h["loss"] for h in saved["history"]]
  np.testing.assert_allclose(multi_losses[:12], losses[:12], rtol=1e-5)
  np.testing.assert_allclose(multi_losses, losses, rtol=2e-3)
  for key in ("loss_scale", "skipped_steps", "last_step_finite"):
    assert [h[key] for h in multi["history"]] == [
      h[key] for h in saved["history"]
    ], key
  assert saved["skipped_steps"] > 0  # the skips were compared, not absent


def test_gpt_example_one_device_step_written_out(tmp_path):
  # The hand-written step: scaled loss, jax.grad (with the FP8 params' grad
  # slots), tx.update, apply_updates.
  (run,) = gpt.main(
    [
      *("--preset", "fp16-mixed", "--fp8", "delayed", "--fp8-params"),
      *("--steps", "20", *TINY, "--growth-interval", "4"),
      *("--eval-every", "10", "--out", str(tmp_path)),
    ]
  )
  saved = json.loads(
    (tmp_path / "gpt-fp16-mixed" / "metrics-fp16-mixed.json").read_text()
  )
  assert saved == json.loads(json.dumps(run))
  assert saved["devices"] == 1 and saved["fp8"]["recipe"] == "DelayedScaling"
  # The FP8 layers' kernels in FP8; the head, embeddings, norms and biases
  # stay float32.
  assert saved["param_dtypes"] == ["float32", "float8_e4m3fn"]
  check_trained(saved)


def test_gpt_example_fp8_params_refuse_blockwise(capsys):
  # Blockwise scaling has a scale per block, an FP8 param one per kernel.
  with pytest.raises(SystemExit):
    gpt.parse_args(["--fp8", "blockwise", "--fp8-params"])
  assert "--fp8-params with --fp8 blockwise" in capsys.readouterr().err


def test_gpt_example_autocast_trains_fp16_with_its_loss_scale(tmp_path):
  # --autocast: the model as written, float16 matmuls per operation, the
  # hand-written step's loss scale at work.
  (run,) = gpt.main(
    [
      *("--preset", "fp16-mixed", "--autocast", "--steps", "16", *TINY),
      *("--growth-interval", "4", "--eval-every", "8", "--out", str(tmp_path)),
    ]
  )
  assert (tmp_path / "gpt-fp16-mixed-autocast" / "curves.png").exists()
  assert run["param_dtypes"] == ["float32"] and run["fp8"] is None
  check_trained(run)


def test_gpt_example_autocast_refuses_fp8(capsys):
  with pytest.raises(SystemExit):
    gpt.parse_args(["--autocast", "--preset", "bf16-fp8-mixed"])
  assert "--autocast runs the model as written" in capsys.readouterr().err


def test_gpt_text_is_the_standard_library_source():
  text = gpt.load_text(50_000)
  assert text.dtype == "uint8" and len(text) == 50_000 and text.max() < 128
  assert b"import " in text.tobytes()

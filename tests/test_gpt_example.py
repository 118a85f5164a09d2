"""examples/gpt.py end to end on a tiny config: ZeRO-1, accumulation, FP8."""

import json
import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(relpath):
  return runpy.run_path(str(ROOT / relpath), run_name="not_main")


def test_gpt_example_zero1_accum_fp8(tmp_path):
  gpt = load("examples/gpt.py")
  (run,) = gpt["main"](
    [
      *("--preset", "fp16-mixed", "--zero1", "--accum", "2", "--fp8"),
      *("--steps", "24", "--layers", "1", "--d-model", "32"),
      *("--seq-len", "16", "--batch-size", "16", "--text-bytes", "200000"),
      *("--growth-interval", "5", "--eval-every", "12", "--out", str(tmp_path)),
    ]
  )
  out = tmp_path / "gpt-fp16-mixed"
  saved = json.loads((out / "metrics-fp16-mixed.json").read_text())
  assert saved["devices"] == 8 and saved["fp8"]["format"] == "hybrid"
  assert saved["config"]["accum"] == 2 and saved["param_dtypes"] == ["float32"]
  losses = [h["loss"] for h in saved["history"]]
  # From ln(128) = 4.85 nats per character (uniform) clearly down.
  assert losses[0] > 4.5 and sum(losses[-4:]) / 4 < 0.75 * losses[0]
  assert saved["evals"][-1]["val_loss"] < 0.8 * losses[0]
  scales = [h["loss_scale"] for h in saved["history"]]
  assert max(scales) > scales[0]  # the scaler grew every 5 finite steps
  assert (out / "curves.png").stat().st_size > 10_000
  # The comparison chart takes several runs (here this one under two names).
  other = dict(run, preset="fp32")
  gpt["plot"]([other, run], tmp_path / "compare.png", "two runs")
  assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_gpt_text_is_the_standard_library_source():
  text = load("examples/gpt.py")["load_text"](50_000)
  assert text.dtype == "uint8" and len(text) == 50_000 and text.max() < 128
  assert b"import " in text.tobytes()

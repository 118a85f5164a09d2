"""The main job and the benchmark run end to end on tiny configs."""

import json
import pathlib
import runpy

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(relpath):
  return runpy.run_path(str(ROOT / relpath), run_name="not_main")


# fp16-mixed, as `make train` runs it (the lean-state benchmark runs every
# bf16 preset through this example).
@pytest.mark.parametrize("preset", ["fp16-mixed"])
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
  # A 12-epoch run (264 steps, the example's schedule spread over them), not
  # the example's 30: both reach their plateau (bf16 0.975 and FP8 0.972
  # against 0.978 and 0.972 after 30 epochs on 2026-11-27; the smallest
  # output-gradient scale 9.3e6, far above the 1e5 checked), in less than
  # half the time.
  flags = ["--model", "mlp", "--epochs", "12", "--out", str(tmp_path)]
  runs = {
    preset: main([*flags, "--preset", preset])
    for preset in ("bf16-mixed", "bf16-fp8-mixed")
  }
  bf16, fp8 = runs["bf16-mixed"], runs["bf16-fp8-mixed"]
  assert bf16["fp8"] is None and fp8["fp8"]["format"] == "hybrid"
  assert bf16["test_accuracy"] > 0.95
  assert abs(fp8["test_accuracy"] - bf16["test_accuracy"]) <= 0.01
  # FP8 was really on: the scales the amaxes gave moved away from 1.
  last = fp8["history"][-1]
  assert last["fp8_input_scale_max"] == 448.0  # inputs are in [0, 1]
  assert (
    1e5 < last["fp8_output_grad_scale_min"] < last["fp8_output_grad_scale_max"]
  )
  assert "fp8_input_scale_max" not in bf16["history"][-1]


def test_digits_fp8_flag_picks_the_recipe(tmp_path):
  main = load("examples/digits.py")["main"]
  flags = ["--model", "mlp", "--preset", "bf16-mixed", "--max-steps", "20"]
  flags += ["--out", str(tmp_path)]
  run = main([*flags, "--fp8", "delayed", "--fp8-history", "4"])
  assert run["fp8"]["recipe"] == "DelayedScaling"
  assert run["fp8"]["amax_history_len"] == 4
  assert (tmp_path / "digits-bf16-mixed-fp8-delayed-mlp").is_dir()
  # The history length belongs to delayed scaling alone.
  with pytest.raises(SystemExit, match="--fp8-history 4 .* --fp8 delayed"):
    main([*flags, "--fp8", "blockwise", "--fp8-history", "4"])
  with pytest.raises(SystemExit):  # argparse: not a recipe name
    main([*flags, "--fp8", "hybrid"])


def test_readme_quick_start_runs():
  readme = (ROOT / "README.md").read_text()
  start = readme.index("<!-- quick-start -->")
  code = readme[start:].split("```python\n", 1)[1].split("```", 1)[0]
  namespace = {}
  exec(compile(code, "README.md quick start", "exec"), namespace)  # noqa: S102
  assert namespace["losses"][-1] < namespace["losses"][0]


def test_example_flags_that_cannot_apply_are_refused_by_name(tmp_path, capsys):
  digits = load("examples/digits.py")
  gpt = load("examples/gpt.py")
  refused = [
    (digits["parse_args"], ["--preset", "bf16-mixed", "--init-scale", "8"]),
    (digits["parse_args"], ["--max-steps", "0"]),
    (digits["parse_args"], ["--epochs", "0"]),
    (gpt["parse_args"], ["--eval-every", "0"]),
    (
      gpt["parse_args"],
      ["--compare", "fp32,bf16-mixed", "--growth-interval", "5"],
    ),
    (gpt["parse_args"], ["--accum", "0"]),
    (gpt["parse_args"], ["--heads", "4", "--d-model", "30"]),
    (gpt["parse_args"], ["--seq-len", "64", "--text-bytes", "600"]),
    (gpt["parse_args"], ["--warmup", "-5"]),
    (gpt["parse_args"], ["--preset", "fp32", "--compare", "fp32,bf16-mixed"]),
  ]
  for parse, argv in refused:
    with pytest.raises(SystemExit):
      parse(argv)
    assert argv[-2] in capsys.readouterr().err, argv
  with pytest.raises(SystemExit):
    gpt["parse_args"](["--compare", "fp32,fp32"])
  assert "names a preset twice" in capsys.readouterr().err
  assert gpt["parse_args"](["--text-bytes", "660"]).text_bytes == 660
  with pytest.raises(
    SystemExit, match="--batch-size 5000 is more than the 1437"
  ):
    digits["main"](["--batch-size", "5000", "--out", str(tmp_path)])
  # Defaults fill in for presets with a dynamic scale, and for none else.
  args = digits["parse_args"](["--preset", "fp16-mixed"])
  assert (args.init_scale, args.growth_interval) == (2.0**15, 100)
  assert digits["parse_args"](["--preset", "bf16-mixed"]).init_scale is None

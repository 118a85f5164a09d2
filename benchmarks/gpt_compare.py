"""The GPT example's presets side by side: `examples/gpt.py --compare`.

Trains the character-level GPT of `examples/gpt.py` once per preset on the
same batches and saves each run's summary without its per-step history
(the chart shows that); `--chart` copies the example's chart there.
Arguments this script does not know go to the example.

  python benchmarks/gpt_compare.py --chart docs/gpt-compare.png
  python benchmarks/gpt_compare.py --steps 6 --layers 1   # a smoke run
"""

import argparse
import pathlib
import shutil
import sys
import tempfile

# The example is a module beside the others in examples/.
sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import gpt
import md

PRESETS = "fp32,bf16-mixed,fp16-mixed"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--presets", default=PRESETS)
  p.add_argument("--chart", default=None, help="copy the chart here")
  p.add_argument("--json", default=None, help="also write results here")
  args, example_args = p.parse_known_args(argv)
  with tempfile.TemporaryDirectory() as out:
    runs = gpt.main(["--compare", args.presets, "--out", out, *example_args])
    if args.chart:
      shutil.copy(pathlib.Path(out) / "gpt-compare" / "curves.png", args.chart)
  result = {
    "runs": [{k: v for k, v in r.items() if k != "history"} for r in runs]
  }
  print(table({"gpt": result}))
  if args.json:
    md.write_json(args.json, result)
  return result


def table(results: dict) -> str:
  """Each preset's first and final losses, skips and time."""
  if not results:
    return md.not_measured("benchmarks/gpt_compare.py")
  (result,) = results.values()
  runs = result["runs"]
  cfg = runs[0]["config"]
  base = runs[0]["final_val_loss"]
  rows = [
    [
      x["preset"],
      f"{x['first_loss']:.3f}",
      f"{x['final_val_loss']:.4f}",
      f"{x['final_val_loss'] - base:+.4f}",
      x["skipped_steps"],
      f"{x['final_loss_scale']:g}",
      f"{x['seconds']:.1f}",
    ]
    for x in runs
  ]
  header = ["preset", "first loss", "final val loss", "vs first row"]
  header += ["skipped steps", "final loss scale", "seconds"]
  spread = max(x["final_val_loss"] for x in runs) - min(
    x["final_val_loss"] for x in runs
  )
  return "\n".join(
    [
      f"`python examples/gpt.py --compare {','.join(x['preset'] for x in runs)}`:"
      f" {cfg['layers']} layers, d_model {cfg['d_model']},"
      f" {cfg['steps']} steps of {cfg['batch_size']} x {cfg['seq_len']}"
      " characters.",
      "",
      md.table(header, rows),
      "",
      f"The final validation losses lie within {spread:.4f} of each other.",
    ]
  )


if __name__ == "__main__":
  main()

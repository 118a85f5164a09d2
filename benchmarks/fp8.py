"""FP8 measurements: matmul time (fp8 vs bf16) and digits accuracy.

1. `--matmul`: forward + backward of one `nn.Dense` (n x n input, n x n
   kernel) with the kernel in bfloat16 and its matmul in bfloat16, or in FP8
   (`jmp_train.fp8.Fp8DotGeneral`, hybrid E4M3/E5M2 with delayed scaling),
   timed side by side (alternating rounds, median). Speed needs a GPU with
   FP8 tensor cores (H100); on CPU FP8 is emulated and slower.
2. `--accuracy`: the digits example's test accuracy for bf16-mixed vs
   bf16-fp8-mixed and fp16-mixed vs fp16-fp8-mixed (MLP and CNN).

  python benchmarks/fp8.py --matmul --sizes 4096,8192    # on a GPU
  python benchmarks/fp8.py --accuracy                    # CPU is fine (default)
"""

import argparse
import json
import pathlib
import sys
import tempfile
import time

# The digits example is a module beside the others in examples/.
sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import digits
import flax.linen as nn
import jax
import jax.numpy as jnp
import md
import numpy as np

from jmp_train import fp8


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--matmul", action="store_true")
  p.add_argument("--accuracy", action="store_true")
  p.add_argument("--sizes", default="4096,8192")
  p.add_argument("--rounds", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--epochs", type=int, default=30, help="digits epochs")
  p.add_argument("--json", default=None, help="also write results here")
  return p.parse_args(argv)


def dense_steps(n):
  """Jitted forward+backward of a bf16 Dense and of its FP8 twin.

  The backward pass pulls back a random cotangent: with `sum(y)` as the loss
  the cotangent is all ones and XLA folds both backward matmuls into row and
  column sums, timing one matmul instead of three.
  """
  kx, kg = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (n, n), jnp.bfloat16)
  g = jax.random.normal(kg, (n, n), jnp.bfloat16)
  steps = {}
  for name, dot in (("bf16", None), ("fp8", fp8.Fp8DotGeneral)):
    layer = nn.Dense(
      n,
      use_bias=False,
      dtype=jnp.bfloat16,
      param_dtype=jnp.bfloat16,
      dot_general_cls=dot,
    )
    variables = layer.init(kx, x)
    meta = variables.get("fp8_meta", {})

    def fwd_bwd(params, meta, x, g, layer=layer):
      def f(params, meta, x):
        return layer.apply({"params": params, "fp8_meta": meta}, x)

      y, pull = jax.vjp(f, params, meta, x)
      return y, pull(g)

    steps[name] = (jax.jit(fwd_bwd), (variables["params"], meta, x, g))
  return steps


def time_matmuls(sizes, rounds, warmup):
  rows = []
  for n in sizes:
    steps = dense_steps(n)
    for grad, args in steps.values():
      for _ in range(warmup):
        jax.block_until_ready(grad(*args))
    times = {name: [] for name in steps}
    for _ in range(rounds):  # alternate, so drift hits both alike
      for name, (grad, args) in steps.items():
        start = time.perf_counter()
        jax.block_until_ready(grad(*args))
        times[name].append(time.perf_counter() - start)
    med = {k: float(np.median(v)) for k, v in times.items()}
    flops = 3 * 2 * n**3  # forward + two backward matmuls
    rows.append(
      {
        "n": n,
        "bf16_ms": 1e3 * med["bf16"],
        "fp8_ms": 1e3 * med["fp8"],
        "speedup_fp8_over_bf16": med["bf16"] / med["fp8"],
        "bf16_tflops": flops / med["bf16"] / 1e12,
        "fp8_tflops": flops / med["fp8"] / 1e12,
      }
    )
  return rows


def digits_accuracy(epochs):
  rows = []
  with tempfile.TemporaryDirectory() as out:
    for model in ("mlp", "cnn"):
      for base in ("bf16", "fp16"):
        accs = {}
        for preset in (f"{base}-mixed", f"{base}-fp8-mixed"):
          summary = digits.main(
            [
              "--model",
              model,
              "--preset",
              preset,
              "--epochs",
              str(epochs),
              "--out",
              out,
            ]
          )
          accs[preset] = summary["test_accuracy"]
        rows.append({"model": model, **accs})
  return rows


def accuracy_table(results: dict) -> str:
  """Digits accuracy of each preset beside its FP8 twin, and the verdict."""
  found = [r["accuracy"] for r in results.values() if "accuracy" in r]
  if not found:
    return md.not_measured("benchmarks/fp8.py --accuracy")
  rows, gaps = [], []
  for a in found[0]:
    (p1, acc1), (p2, acc2) = list(a.items())[1:]
    gaps.append(abs(acc2 - acc1))
    rows.append(
      [
        a["model"],
        p1,
        f"{acc1:.4f}",
        p2,
        f"{acc2:.4f}",
        f"{100 * (acc2 - acc1):+.2f} pt",
      ]
    )
  header = ["model", "preset", "accuracy", "fp8 preset", "accuracy"]
  return "\n".join(
    [
      md.table([*header, "difference"], rows),
      "",
      f"Goal (within 1 point of bf16): largest gap {100 * max(gaps):.2f} pt,"
      f" {md.verdict(max(gaps) <= 0.01)}.",
    ]
  )


def matmul_table(results: dict) -> str:
  """bf16 against FP8 matmul time per size, and the verdict at the largest."""
  found = [r for r in results.values() if "matmul" in r]
  if not found:
    return md.not_measured("benchmarks/fp8.py --matmul")
  m = found[0]
  rows = [
    [
      x["n"],
      f"{x['bf16_ms']:.3f}",
      f"{x['fp8_ms']:.3f}",
      f"{x['speedup_fp8_over_bf16']:.2f}x",
      f"{x['bf16_tflops']:.1f}",
      f"{x['fp8_tflops']:.1f}",
    ]
    for x in m["matmul"]
  ]
  big = max(m["matmul"], key=lambda x: x["n"])
  speedup = big["speedup_fp8_over_bf16"]
  header = ["n", "bf16 ms", "fp8 ms", "fp8 speed-up", "bf16 TFLOP/s"]
  return "\n".join(
    [
      f"On {m['device']}:",
      "",
      md.table([*header, "fp8 TFLOP/s"], rows),
      "",
      "Goal (issue 4): fp8 >= 1.3x bf16 at the largest size:"
      f" {speedup:.2f}x at n = {big['n']}, {md.verdict(speedup >= 1.3)}.",
    ]
  )


def main(argv=None):
  args = parse_args(argv)
  if not (args.matmul or args.accuracy):
    args.accuracy = True  # the measurement any machine can make
  result = {"device": str(jax.devices()[0].device_kind)}
  if args.matmul:
    sizes = [int(s) for s in args.sizes.split(",")]
    result["matmul"] = time_matmuls(sizes, args.rounds, args.warmup)
    print(f"Dense forward+backward on {result['device']}:\n")
    print(
      "| n | bf16 ms | fp8 ms | fp8 speed-up | bf16 TFLOP/s | fp8 TFLOP/s |"
    )
    print("|---|---|---|---|---|---|")
    for r in result["matmul"]:
      print(
        f"| {r['n']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | "
        f"{r['speedup_fp8_over_bf16']:.2f}x | {r['bf16_tflops']:.1f} | "
        f"{r['fp8_tflops']:.1f} |"
      )
  if args.accuracy:
    result["accuracy"] = digits_accuracy(args.epochs)
    print(
      "\n| model | preset | accuracy | fp8 preset | accuracy | difference |"
    )
    print("|---|---|---|---|---|---|")
    for r in result["accuracy"]:
      (a, acc_a), (b, acc_b) = list(r.items())[1:]
      print(
        f"| {r['model']} | {a} | {acc_a:.4f} | {b} | {acc_b:.4f} | "
        f"{100 * (acc_b - acc_a):+.2f} pt |"
      )
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()

"""GPT-2 small's output layer and loss: whole logits against the fused loss.

The forward and backward pass (`jax.value_and_grad`, jitted) of the last
step of GPT-2 small's loss: bfloat16 hidden states (batch x 1024 rows, d_model
768) times the tied bfloat16 embedding (50304 x 768), the mean cross-entropy
in float32, computed these ways:

- logits: `gpt_model.cross_entropy(x @ table.T, targets)`, what the model
  without targets and `gpt2.py --loss logits` do: the (rows, vocab) logits in
  bfloat16, read in float32 in one pass for their log-sum-exp, and their
  gradient in one more (its backward pass is written out);
- logits, LSE in n slices (`--lse-slices`): the same with
  `slices=n`, each row of logits cut in n parts for its one-pass
  log-sum-exp (`gpt_model.logsumexp_one_pass`; the first variant's rows are
  cut in gcd(vocabulary, 128));
- logits, two-pass logsumexp: the same with `one_pass=False`, the
  log-sum-exp of `jax.nn.logsumexp` (its max, then its sum of exponentials:
  two passes over the logits; until 2026-11-27);
- logits, optax's loss: `optax.softmax_cross_entropy_with_integer_labels`
  of the float32 logits, differentiated by JAX (what `cross_entropy` was
  until 2026-11-27): the float32 softmax written, the one-hot scattered into
  it, then cast;
- fused (chunk c): `gpt_model.fused_cross_entropy(x, table, targets, c)`,
  what `gpt2.py --loss fused` does: c rows of float32 logits at a time,
  computed again in the backward pass.

For each: the temporaries XLA allocates for the compiled function
(`memory_analysis().temp_size_in_bytes`, read without running it) and the
bytes its kernels move (`overhead.kernel_summary`), and on a GPU the loss it
computes and the median time of alternating rounds (on CPU, bfloat16 matmuls
are emulated and 3.8 TFLOP per call take minutes: not run). `--target h100`
compiles for that GPU on a machine without one (`benchmarks/deviceless.py`).

  python benchmarks/loss_head.py                    # any machine
  python benchmarks/loss_head.py --target h100      # needs JAX's CUDA plugin
  python benchmarks/loss_head.py --batch 2 --vocab 1024 --chunks 256  # tiny
"""

import argparse
import functools
import pathlib
import re
import statistics
import sys
import time

sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import deviceless
import gpt_model
import jax
import jax.numpy as jnp
import md
import numpy as np
import optax
import overhead

GIB = 2**30


def _positive_ints(text: str) -> list[int]:
  """`--chunks` and `--lse-slices`: positive ints, comma-separated."""
  try:
    values = [int(c) for c in text.split(",")]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(
      f"{text!r} is not a comma-separated list of positive ints"
    )
  return values


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--d-model", type=int, default=768)
  p.add_argument("--vocab", type=int, default=50304)
  p.add_argument(
    "--chunks",
    type=_positive_ints,
    default="1024,2048,4096,8192",
    help="comma-separated rows per chunk of the fused loss",
  )
  p.add_argument(
    "--lse-slices",
    type=_positive_ints,
    default=None,
    help="comma-separated: for each, the whole logits' loss with its rows"
    " cut in that many parts for the log-sum-exp (gpt_model.cross_entropy's"
    " slices; each a divisor of --vocab)",
  )
  p.add_argument("--rounds", type=int, default=10)
  deviceless.add_target_argument(p)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  for n in args.lse_slices or []:
    try:  # the rule cross_entropy applies, at parse time
      gpt_model.checked_slices(n, args.vocab)
    except ValueError as e:
      p.error(f"--lse-slices: {e}")
  return args


def main(argv=None):
  args = parse_args(argv)
  topo = deviceless.start(args.target)
  rows = args.batch * args.seq
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(rows, args.d_model)), jnp.bfloat16)
  table_ = jnp.asarray(
    0.02 * rng.normal(size=(args.vocab, args.d_model)), jnp.bfloat16
  )
  targets = jnp.asarray(rng.integers(0, args.vocab, rows), jnp.int32)

  def logits_loss(x, table, targets):
    return gpt_model.cross_entropy(jnp.dot(x, table.T), targets)

  def optax_loss(x, table, targets):
    logits = jnp.dot(x, table.T).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return losses.mean()

  def two_pass_loss(x, table, targets):
    logits = jnp.dot(x, table.T)
    return gpt_model.cross_entropy(logits, targets, one_pass=False)

  variants = {"logits": logits_loss}

  def sliced_loss(slices, x, table, targets):
    return gpt_model.cross_entropy(jnp.dot(x, table.T), targets, slices=slices)

  for n in args.lse_slices or []:
    variants[f"logits, LSE in {n} slices"] = functools.partial(sliced_loss, n)
  variants |= {
    "logits, two-pass logsumexp": two_pass_loss,
    "logits, optax's loss": optax_loss,
  }
  for c in args.chunks:
    variants[f"fused (chunk {c})"] = lambda x, t, y, c=c: (
      gpt_model.fused_cross_entropy(x, t, y, c)
    )
  on_gpu = jax.devices()[0].platform == "gpu" and not args.target
  if topo:
    inputs = deviceless.abstract((x, table_, targets), topo)
  else:
    inputs = (x, table_, targets)
  compiled, out = {}, []
  for name, fn in variants.items():
    compiled[name] = (
      jax.jit(jax.value_and_grad(fn, (0, 1))).lower(*inputs).compile()
    )
    temp = compiled[name].memory_analysis().temp_size_in_bytes
    hlo = compiled[name].as_text()
    kernels = overhead.kernel_summary(hlo)
    # A loop's kernels are counted once, not once per chunk: the fused
    # losses' bytes are not what they move, and are left out.
    looped = re.search(r"\swhile\(", hlo) is not None
    out.append(
      {
        "variant": name,
        "temp_bytes": int(temp),
        "kernels": None if looped else kernels["total"],
        "mbytes": None if looped else kernels["mbytes"],
      }
    )
  if on_gpu:  # the loss, then alternating rounds, the median per variant
    for row in out:
      row["loss"] = float(compiled[row["variant"]](x, table_, targets)[0])
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
      for name, fn in compiled.items():
        jax.block_until_ready(fn(x, table_, targets))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, table_, targets))
        times[name].append(time.perf_counter() - t0)
    for row in out:
      row["ms"] = round(1e3 * statistics.median(times[row["variant"]]), 3)
  result = {
    "shape": f"{rows} rows (batch {args.batch} x {args.seq}), d_model"
    f" {args.d_model}, vocabulary {args.vocab}",
    **deviceless.provenance(args.target),
    "rows": out,
  }
  print(table({"loss-head": result}))
  if args.json:
    md.write_json(args.json, result)
  return result


def table(results: dict) -> str:
  """Per run: each variant's XLA temporaries beside the whole-logits
  loss's (and on a GPU its time and the loss it computed)."""
  if not results:
    return md.not_measured("benchmarks/loss_head.py")
  out = []
  for r in results.values():
    base = r["rows"][0]
    timed, moved = "ms" in base, "mbytes" in base  # moved: since 2026-11-27
    rows = [
      [
        x["variant"],
        f"{x['temp_bytes'] / GIB:.3f}",
        md.ratio(x["temp_bytes"] / base["temp_bytes"]),
        *(
          (
            [
              f"{x['kernels']}",
              f"{x['mbytes']:,.0f}",
              md.ratio(x["mbytes"] / base["mbytes"]),
            ]
            if x["mbytes"] is not None
            else ["(a loop)", "", ""]
          )
          if moved
          else []
        ),
        *(
          [f"{x['ms']:.2f}", md.ratio(x["ms"] / base["ms"]), f"{x['loss']:.5f}"]
          if timed
          else []
        ),
      ]
      for x in r["rows"]
    ]
    header = ["loss", "temp GiB (XLA)", "vs logits"]
    header += ["kernels", "MB moved", "vs logits"] if moved else []
    header += ["ms (fwd+bwd)", "vs logits", "loss value"] if timed else []
    out += [
      f"{r['shape']}; on {r['device']} (jax {r['jax']}).",
      "",
      md.table(header, rows),
      "",
    ]
  return "\n".join(out).rstrip()


if __name__ == "__main__":
  main()

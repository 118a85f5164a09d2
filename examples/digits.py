"""Train a small CNN on scikit-learn's bundled 8x8 digits with a jmp_train preset.

  python examples/digits.py                        # fp16-mixed: f16 compute, loss scaling
  python examples/digits.py --preset bf16-true     # bf16 params + FP32 master weights
  python examples/digits.py --preset fp32 --epochs 10
  python examples/digits.py --model mlp --preset bf16-fp8-mixed   # FP8 matmuls
  python examples/digits.py --model mlp --preset bf16-mixed --fp8 blockwise

Writes runs/digits-<preset>[-fp8-<recipe>][-mlp]/metrics.json and curves.png.
The data ships with scikit-learn: nothing is downloaded.
"""

import argparse
import dataclasses
import json
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jmp_train

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# --fp8 names: the jmp_train.fp8 recipes at their defaults ("default" is
# what `linen.wrap(fp8=True)` and the fp8 presets use), and "off".
FP8_RECIPES = {
  "default": jmp_train.fp8.DEFAULT_RECIPE,
  "delayed": jmp_train.fp8.DelayedScaling(),
  "current": jmp_train.fp8.CurrentScaling(),
  "current-pow2": jmp_train.fp8.CurrentScaling(power_of_two_scales=True),
  "blockwise": jmp_train.fp8.BlockwiseScaling(),
  "off": None,
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--preset", default="fp16-mixed", choices=list(jmp_train.PRESETS)
  )
  p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
  p.add_argument("--epochs", type=int, default=30)
  p.add_argument("--batch-size", type=int, default=64)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--weight-decay", type=float, default=1e-4)
  p.add_argument(
    "--init-scale",
    type=float,
    default=None,
    help="initial loss scale (default 2**15; presets with dynamic scaling)",
  )
  p.add_argument(
    "--growth-interval",
    type=int,
    default=None,
    help="finite steps between loss-scale growths (default 100, shorter "
    "than the presets' 2000 so a short run shows the scaler work; presets "
    "with dynamic scaling)",
  )
  p.add_argument(
    "--max-steps",
    type=int,
    default=None,
    help="stop after this many steps of the planned run (tests)",
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs", help="output folder")
  p.add_argument(
    "--fp8",
    nargs="?",
    const="default",
    choices=list(FP8_RECIPES),
    help="FP8 matmuls (head excluded) with this recipe; alone: the default "
    "recipe; without it: the preset's (FP8 for the fp8 presets only)",
  )
  p.add_argument(
    "--fp8-history",
    type=int,
    default=None,
    help="amax history length of delayed scaling (default: the recipe's)",
  )
  args = p.parse_args(argv)
  for flag in ("epochs", "batch_size", "max_steps"):
    value = getattr(args, flag)
    if value is not None and value < 1:
      p.error(f"--{flag.replace('_', '-')} must be 1 or more, got {value}")
  dynamic = isinstance(
    jmp_train.get_preset(args.preset).loss_scale, jmp_train.DynamicLossScale
  )
  given = [
    f for f in ("init_scale", "growth_interval") if getattr(args, f) is not None
  ]
  if given and not dynamic:
    p.error(
      f"--{given[0].replace('_', '-')} sets a dynamic loss scale, and preset "
      f"{args.preset} has none: leave it out"
    )
  if dynamic:
    args.init_scale = 2.0**15 if args.init_scale is None else args.init_scale
    if args.growth_interval is None:
      args.growth_interval = 100
  return args


class CNN(nn.Module):
  """Two conv blocks with BatchNorm, then an MLP head."""

  @nn.compact
  def __call__(self, x, train: bool):
    for features in (32, 64):
      x = nn.Conv(features, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
      x = nn.relu(x)
    x = nn.avg_pool(x, (2, 2), strides=(2, 2)).reshape(x.shape[0], -1)
    x = nn.relu(nn.Dense(128)(x))
    x = nn.Dropout(0.2, deterministic=not train)(x)
    return nn.Dense(10, name="head")(x)


class MLP(nn.Module):
  """Three Dense layers on the flattened image: every matmul can be FP8."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = x.reshape(x.shape[0], -1)
    for features in (256, 256):
      x = nn.relu(nn.Dense(features)(x))
    x = nn.Dropout(0.1, deterministic=not train)(x)
    return nn.Dense(10, name="head")(x)


def main(argv=None):
  args = parse_args(argv)
  name = f"digits-{args.preset}" + (f"-fp8-{args.fp8}" if args.fp8 else "")
  name += "-mlp" if args.model == "mlp" else ""
  out_dir = pathlib.Path(args.out) / name
  out_dir.mkdir(parents=True, exist_ok=True)

  # Data: 1797 8x8 images, 80/20 stratified split.
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  x_train, x_test, y_train, y_test = train_test_split(
    images,
    digits.target,
    test_size=0.2,
    stratify=digits.target,
    random_state=args.seed,
  )
  steps_per_epoch = len(x_train) // args.batch_size
  if steps_per_epoch == 0:
    raise SystemExit(
      f"--batch-size {args.batch_size} is more than the {len(x_train)} "
      "training images: give at most that many."
    )
  # --max-steps stops the planned run early: the schedule is the plan's, so
  # a shorter run is the start of the full one.
  planned_steps = args.epochs * steps_per_epoch
  total_steps = planned_steps
  if args.max_steps is not None:
    total_steps = min(total_steps, args.max_steps)

  # Model and optimizer from the preset. A dynamic loss scale keeps the
  # preset's settings but starts at --init-scale and grows every
  # --growth-interval finite steps.
  preset = jmp_train.get_preset(args.preset)
  if isinstance(preset.loss_scale, jmp_train.DynamicLossScale):
    loss_scale = dataclasses.replace(
      preset.loss_scale, loss_scale=args.init_scale, period=args.growth_interval
    )
    preset = dataclasses.replace(preset, loss_scale=loss_scale)
  recipe = preset.fp8 if args.fp8 is None else FP8_RECIPES[args.fp8]
  if args.fp8_history is not None:
    if not isinstance(recipe, jmp_train.fp8.DelayedScaling):
      raise SystemExit(
        f"--fp8-history {args.fp8_history} sets delayed scaling's amax "
        f"history; the FP8 recipe here is {recipe!r}: add --fp8 delayed."
      )
    recipe = dataclasses.replace(recipe, amax_history_len=args.fp8_history)
  # With FP8 (an fp8 preset or --fp8), every matmul but the output head.
  model = jmp_train.linen.wrap(
    {"cnn": CNN, "mlp": MLP}[args.model](),
    preset.policy,
    fp8=recipe,
    fp8_exclude=("head",),
  )
  key = jax.random.key(args.seed)
  # Under jit, as Flax's examples initialise: one compiled program, where
  # eager init compiles each initializer on its own (the same values).
  variables = jax.jit(lambda key, x: model.init(key, x, train=False))(
    key, jnp.zeros((1, 8, 8, 1))
  )
  params = variables["params"]
  batch_stats = variables.get("batch_stats", {})
  fp8_meta = variables.get("fp8_meta", {})
  schedule = optax.cosine_decay_schedule(args.lr, planned_steps)
  # The preset's loss scale, param-update rule and optimizer-state formats.
  tx = preset.mixed_precision(
    optax.adamw(schedule, weight_decay=args.weight_decay)
  )
  opt_state = jax.jit(tx.init)(params)
  initial_scale = float(jmp_train.current_loss_scale(opt_state))

  @jax.jit
  def train_step(params, batch_stats, fp8_meta, opt_state, x, y, key):
    def loss_fn(p, meta):
      logits, new = model.apply(
        {"params": p, "batch_stats": batch_stats, "fp8_meta": meta},
        x,
        train=True,
        mutable=["batch_stats"],
        rngs={"dropout": key},
      )
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss * jmp_train.current_loss_scale(opt_state), (loss, new)

    # The FP8 state's "gradients" are this step's amaxes.
    (grads, fp8_grads), (loss, new) = jax.grad(
      loss_fn, argnums=(0, 1), has_aux=True
    )(params, fp8_meta)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = jmp_train.train_metrics(opt_state)
    finite = metrics["last_step_finite"]
    # A skipped step changes nothing: keep the old BatchNorm statistics and
    # FP8 scales too.
    batch_stats = jmp_train.select_tree(
      finite, new.get("batch_stats", {}), batch_stats
    )
    fp8_meta = jmp_train.fp8.update(fp8_meta, fp8_grads, finite=finite)
    metrics = {"loss": loss, **metrics, **jmp_train.fp8.scales(fp8_meta)}
    return params, batch_stats, fp8_meta, opt_state, metrics

  @jax.jit
  def accuracy(params, batch_stats, fp8_meta, x, y):
    logits = model.apply(
      {"params": params, "batch_stats": batch_stats, "fp8_meta": fp8_meta},
      x,
      train=False,
    )
    return jnp.mean(jnp.argmax(logits, -1) == y)

  # Loop.
  rng = np.random.default_rng(args.seed)
  history, evals = [], []
  start = time.perf_counter()
  desc = f"digits {args.preset}" + (f" fp8 {args.fp8}" if args.fp8 else "")
  bar = tqdm(range(total_steps), desc=desc, unit="step")
  for step in bar:
    if step % steps_per_epoch == 0:
      order = rng.permutation(len(x_train))
    idx = order[(step % steps_per_epoch) * args.batch_size :][: args.batch_size]
    key, sub = jax.random.split(key)
    params, batch_stats, fp8_meta, opt_state, m = train_step(
      params, batch_stats, fp8_meta, opt_state, x_train[idx], y_train[idx], sub
    )
    history.append({k: v.item() for k, v in jax.device_get(m).items()})
    if (step + 1) % steps_per_epoch == 0 or step + 1 == total_steps:
      acc = float(accuracy(params, batch_stats, fp8_meta, x_test, y_test))
      evals.append({"step": step + 1, "test_accuracy": acc})
      bar.set_postfix(
        loss=f"{history[-1]['loss']:.3f}",
        scale=f"{history[-1]['loss_scale']:.0f}",
        acc=f"{acc:.3f}",
      )
  seconds = time.perf_counter() - start

  # Outputs: metrics JSON and curves.
  final = jmp_train.train_metrics(opt_state)
  summary = {
    "preset": args.preset,
    "model": args.model,
    "policy": str(preset.policy),
    "fp8": (
      {"recipe": type(recipe).__name__, **dataclasses.asdict(recipe)}
      if recipe
      else None
    ),
    "config": vars(args),
    "steps": total_steps,
    "seconds": round(seconds, 2),
    "test_accuracy": evals[-1]["test_accuracy"],
    "skipped_steps": int(final["skipped_steps"]),
    "final_loss_scale": float(final["loss_scale"]),
    "param_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(params)}),
    "evals": evals,
    "history": history,
  }
  (out_dir / "metrics.json").write_text(json.dumps(summary, indent=1))

  steps = np.arange(1, len(history) + 1)
  skipped = [i + 1 for i, h in enumerate(history) if not h["last_step_finite"]]
  fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  ax1.plot(steps, [h["loss"] for h in history], lw=0.8, label="train loss")
  ax1.set_yscale("log")
  ax1.set_ylabel("cross-entropy")
  ax1.set_title(
    f"digits {args.model}, {args.preset}: test accuracy "
    f"{summary['test_accuracy']:.3f}\n{preset.policy}",
    fontsize=10,
  )
  ax1.legend()
  ax2.plot(
    steps, [h["loss_scale"] for h in history], color="C1", label="loss scale"
  )
  if skipped:
    # The scale the overflowing step used: the one after the step before it.
    used = [initial_scale] + [h["loss_scale"] for h in history]
    scale_at = [used[i - 1] for i in skipped]
    ax2.scatter(
      skipped,
      scale_at,
      color="C3",
      marker="x",
      zorder=3,
      label=f"skipped steps ({len(skipped)})",
    )
  ax2.set_yscale("log", base=2)
  ax2.set_xlabel("step")
  ax2.set_ylabel("loss scale")
  ax2.legend()
  fig.tight_layout()
  fig.savefig(out_dir / "curves.png", dpi=120)
  plt.close(fig)

  print(
    f"test accuracy {summary['test_accuracy']:.4f} after {total_steps} steps "
    f"in {seconds:.1f}s; skipped {summary['skipped_steps']} steps; final "
    f"loss scale {summary['final_loss_scale']:g}; params "
    f"{', '.join(summary['param_dtypes'])}"
  )
  print(f"wrote {out_dir / 'metrics.json'} and {out_dir / 'curves.png'}")
  return summary


if __name__ == "__main__":
  main()

"""Train a small character-level GPT on the Python standard library's own source.

  python examples/gpt.py                              # bf16-mixed, one device
  python examples/gpt.py --preset fp16-mixed          # loss scaling at work
  python examples/gpt.py --zero1 --accum 2            # ZeRO-1 on 8 virtual CPU devices
  python examples/gpt.py --preset bf16-mixed --fp8    # FP8 matmuls (head excluded)
  python examples/gpt.py --compare fp32,bf16-mixed,fp16-mixed   # one chart

The text is the .py files next to the `os` module (Python's own library), read
as ASCII: it exists on every machine with Python, so nothing is downloaded.
Writes runs/gpt-<preset>/metrics-<preset>.json and curves.png (with --compare:
runs/gpt-compare/, one metrics file per preset and one chart).

The model is a pre-norm transformer with causal self-attention whose softmax
runs in float32 whatever the compute dtype; LayerNorm params and compute stay
float32 (the wrapper's defaults) and the loss is computed in float32.
"""

import os
import sys

if "--zero1" in sys.argv and "jax" not in sys.modules:
  # The virtual-device mesh must exist before jax initialises its backend.
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  )

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jmp_train  # noqa: E402
from jmp_train import monitor, sharding  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

VOCAB = 128  # ASCII


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--preset", default="bf16-mixed", choices=list(jmp_train.PRESETS)
  )
  p.add_argument(
    "--compare",
    default=None,
    help="comma-separated presets to train one after another and plot "
    "on one chart (e.g. fp32,bf16-mixed,fp16-mixed)",
  )
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=30)
  p.add_argument("--zero1", action="store_true", help="ZeRO-1 on 8 devices")
  p.add_argument(
    "--accum", type=int, default=1, help="micro-batches per step (float32)"
  )
  p.add_argument(
    "--fp8", action="store_true", help="FP8 matmuls (delayed scaling)"
  )
  p.add_argument(
    "--init-scale", type=float, default=2.0**15, help="initial loss scale"
  )
  p.add_argument(
    "--growth-interval",
    type=int,
    default=50,
    help="finite steps between loss-scale growths (short, to show it work)",
  )
  p.add_argument("--eval-every", type=int, default=25)
  p.add_argument(
    "--text-bytes", type=int, default=2_000_000, help="corpus size"
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs", help="output folder")
  return p.parse_args(argv)


def load_text(max_bytes: int) -> np.ndarray:
  """The standard library's top-level .py files, as ASCII codes (uint8)."""
  root = pathlib.Path(os.__file__).parent
  chunks, size = [], 0
  for path in sorted(root.glob("*.py")):
    data = path.read_bytes()
    chunks.append(data)
    size += len(data)
    if size >= max_bytes:
      break
  codes = np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)
  return np.where(codes < VOCAB, codes, ord("?")).astype(np.uint8)


class CausalSelfAttention(nn.Module):
  heads: int
  fused: bool = False  # jax.nn.dot_product_attention (cuDNN flash on GPU)

  @nn.compact
  def __call__(self, x):
    batch, seq, d = x.shape
    head_dim = d // self.heads
    qkv = nn.DenseGeneral((3, self.heads, head_dim), name="qkv")(x)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if self.fused:  # the kernels keep softmax statistics in float32
      # cuDNN flash attention takes bf16/fp16 on GPUs; JAX's default (None)
      # is its XLA implementation, which materializes the T x T scores.
      cudnn = jax.default_backend() == "gpu" and q.dtype in (
        jnp.bfloat16,
        jnp.float16,
      )
      y = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn" if cudnn else None
      )
      return nn.Dense(d, name="proj")(y.reshape(batch, seq, d))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), jnp.bool_))
    # Softmax in float32, whatever the compute dtype (the ANCHORS trap).
    logits = jnp.where(causal, logits.astype(jnp.float32), -1e30)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d)
    return nn.Dense(d, name="proj")(y)


class Block(nn.Module):
  heads: int
  fused: bool = False

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    attn = CausalSelfAttention(self.heads, self.fused, name="attn")
    x = x + attn(nn.LayerNorm()(x))
    h = nn.gelu(nn.Dense(4 * d, name="fc")(nn.LayerNorm()(x)))
    return x + nn.Dense(d, name="out")(h)


class GPT(nn.Module):
  """GPT-2's layout; `tied=True` reads logits off the token embedding."""

  layers: int
  d_model: int
  heads: int
  seq_len: int
  vocab: int = VOCAB
  tied: bool = False
  fused_attention: bool = False

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.d_model, name="embed")
    pos = self.param(
      "pos", nn.initializers.normal(0.02), (self.seq_len, self.d_model)
    )
    x = embed(tokens) + pos[: tokens.shape[1]]
    for i in range(self.layers):
      x = Block(self.heads, self.fused_attention, name=f"block{i}")(x)
    x = nn.LayerNorm(name="ln_f")(x)
    if self.tied:
      return embed.attend(x)
    return nn.Dense(self.vocab, name="head")(x)


def cross_entropy(logits, targets):
  logits = logits.astype(jnp.float32)  # the loss in float32
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train(args, preset_name, text, out_dir):
  """One run; returns its summary (also in out_dir/metrics-<preset>.json)."""
  preset = jmp_train.get_preset(preset_name)
  loss_scale = preset.loss_scale
  if isinstance(loss_scale, jmp_train.DynamicLossScale):
    loss_scale = jmp_train.dynamic_loss_scale(
      init_scale=args.init_scale, growth_interval=args.growth_interval
    )
  recipe = preset.fp8 or (jmp_train.fp8.Fp8Recipe() if args.fp8 else None)
  model = jmp_train.linen.wrap(
    GPT(args.layers, args.d_model, args.heads, args.seq_len),
    preset.policy,
    fp8=recipe,
    fp8_exclude=("head",),
  )
  variables = model.init(
    jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32)
  )
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    args.lr,
    min(args.warmup, args.steps // 2),
    args.steps,
    end_value=args.lr / 10,
  )
  tx = jmp_train.mixed_precision(
    optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(schedule, b2=0.95, weight_decay=0.1),
    ),
    loss_scale=loss_scale,
    master_weights=preset.master_weights,
  )

  def loss_fn(variables, batch):
    logits = model.apply(variables, batch[:, :-1])
    return cross_entropy(logits, batch[:, 1:])

  devices = jax.devices()[: 8 if args.zero1 else 1]
  if args.zero1 and len(devices) < 8:
    raise SystemExit("--zero1 needs 8 devices (run it as a script)")
  mesh = jax.make_mesh(
    (len(devices),),
    ("data",),
    axis_types=(jax.sharding.AxisType.Auto,),
    devices=devices,
  )
  step = sharding.make_train_step(
    loss_fn, tx, mesh=mesh, accum_steps=args.accum
  )
  params, opt_state = step.init(variables)
  alarms_fn = jax.jit(monitor.warn_loss_scale)
  eval_loss = jax.jit(loss_fn)

  split = int(0.9 * len(text))
  train_text, val_text = text[:split], text[split:]
  rng = np.random.default_rng(args.seed)

  def windows(source, n):
    starts = rng.integers(0, len(source) - args.seq_len - 1, n)
    return np.stack([source[s : s + args.seq_len + 1] for s in starts])

  val_batches = [
    jnp.asarray(windows(val_text, args.batch_size), jnp.int32) for _ in range(4)
  ]
  initial_scale = float(jmp_train.current_loss_scale(opt_state))
  history, evals = [], []
  start = time.perf_counter()
  bar = tqdm(range(args.steps), desc=f"gpt {preset_name}", unit="step")
  for i in bar:
    batch = jnp.asarray(windows(train_text, args.batch_size), jnp.int32)
    params, opt_state, metrics = step(params, opt_state, batch)
    metrics["alarm"] = jnp.any(jnp.stack(list(alarms_fn(opt_state).values())))
    history.append({k: v.item() for k, v in jax.device_get(metrics).items()})
    if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
      val = float(np.mean([eval_loss(params, b) for b in val_batches]))
      evals.append({"step": i + 1, "val_loss": val})
      bar.set_postfix(
        loss=f"{history[-1]['loss']:.3f}",
        val=f"{val:.3f}",
        scale=f"{history[-1]['loss_scale']:g}",
      )
  seconds = time.perf_counter() - start

  final = jmp_train.train_metrics(opt_state)
  summary = {
    "preset": preset_name,
    "policy": str(preset.policy),
    "fp8": dataclasses.asdict(recipe) if recipe else None,
    "config": vars(args),
    "devices": len(devices),
    "steps": args.steps,
    "seconds": round(seconds, 2),
    "first_loss": history[0]["loss"],
    "final_val_loss": evals[-1]["val_loss"],
    "skipped_steps": int(final["skipped_steps"]),
    "final_loss_scale": float(final["loss_scale"]),
    "initial_loss_scale": initial_scale,
    "param_dtypes": sorted(
      {str(p.dtype) for p in jax.tree.leaves(params["params"])}
    ),
    "evals": evals,
    "history": history,
  }
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"metrics-{preset_name}.json").write_text(
    json.dumps(summary, indent=1)
  )
  print(
    f"{preset_name}: loss {summary['first_loss']:.3f} -> val "
    f"{summary['final_val_loss']:.3f} in {args.steps} steps, {seconds:.1f}s; "
    f"skipped {summary['skipped_steps']} steps; final loss scale "
    f"{summary['final_loss_scale']:g}"
  )
  return summary


def _smooth(xs, window=10):
  xs = np.asarray(xs, np.float64)
  kernel = np.ones(min(window, len(xs))) / min(window, len(xs))
  return np.convolve(xs, kernel, mode="valid")


def plot(runs, path, title):
  """Train loss (moving average) and val loss; val differences; loss scales."""
  fig, (ax1, ax2, ax3) = plt.subplots(
    3, 1, figsize=(8, 8), sharex=True, height_ratios=(3, 1.3, 1.3)
  )
  styles = ["-", "--", ":", "-."]
  base = run0 = runs[0]
  for n, run in enumerate(runs):
    h, style = run["history"], styles[n % len(styles)]
    smooth = _smooth([r["loss"] for r in h])
    steps = np.arange(len(h) - len(smooth) + 1, len(h) + 1)
    ax1.plot(steps, smooth, style, lw=1.2, color=f"C{n}")
    eval_steps = [e["step"] for e in run["evals"]]
    ax1.plot(
      eval_steps,
      [e["val_loss"] for e in run["evals"]],
      "o",
      ms=3,
      color=f"C{n}",
      label=f"{run['preset']} (final val {run['final_val_loss']:.3f})",
    )
    ax2.plot(
      eval_steps,
      [
        e["val_loss"] - b["val_loss"]
        for e, b in zip(run["evals"], base["evals"], strict=True)
      ],
      style + "o",
      ms=3,
      color=f"C{n}",
    )
    ax3.plot(
      np.arange(1, len(h) + 1),
      [r["loss_scale"] for r in h],
      style,
      color=f"C{n}",
      label=f"{run['preset']} ({run['skipped_steps']} skipped)",
    )
    skipped = [i + 1 for i, r in enumerate(h) if not r["last_step_finite"]]
    if skipped:
      used = [run["initial_loss_scale"]] + [r["loss_scale"] for r in h]
      ax3.scatter(
        skipped, [used[i - 1] for i in skipped], color="C3", marker="x"
      )
  ax1.set_ylabel("cross-entropy\n(train: 10-step mean; val: dots)")
  ax1.set_title(title, fontsize=10)
  ax1.legend()
  ax2.axhline(0, color="grey", lw=0.5)
  ax2.set_ylabel(f"val loss minus\n{run0['preset']}'s")
  ax3.set_yscale("log", base=2)
  ax3.set_xlabel("step")
  ax3.set_ylabel("loss scale")
  ax3.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  args = parse_args(argv)
  text = load_text(args.text_bytes)
  presets = args.compare.split(",") if args.compare else [args.preset]
  for name in presets:
    if name not in jmp_train.PRESETS:
      raise SystemExit(
        f"unknown preset {name!r}; known: {', '.join(jmp_train.PRESETS)}"
      )
  out_dir = pathlib.Path(args.out) / (
    "gpt-compare" if args.compare else f"gpt-{args.preset}"
  )
  runs = [train(args, name, text, out_dir) for name in presets]
  mode = []
  if args.zero1:
    mode.append("ZeRO-1 x8")
  if args.accum > 1:
    mode.append(f"accum {args.accum}")
  if args.fp8:
    mode.append("fp8")
  title = (
    f"char GPT ({args.layers}x{args.d_model}, {len(text) / 1e6:.1f} MB of "
    f"stdlib source){', ' + ', '.join(mode) if mode else ''}"
  )
  plot(runs, out_dir / "curves.png", title)
  print(f"wrote {out_dir}/metrics-*.json and {out_dir / 'curves.png'}")
  return runs


if __name__ == "__main__":
  main()

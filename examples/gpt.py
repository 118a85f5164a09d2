"""Train a small character-level GPT on the Python standard library's own source.

  python examples/gpt.py                              # bf16-mixed, one device
  python examples/gpt.py --preset fp16-mixed          # loss scaling at work
  python examples/gpt.py --zero1 --accum 2            # ZeRO-1 on 8 virtual CPU devices
  python examples/gpt.py --fp8                        # FP8 matmuls (head excluded)
  python examples/gpt.py --fp8 delayed                # ... with another recipe
  python examples/gpt.py --fp8 --fp8-params           # ... and FP8 kernels
  python examples/gpt.py --autocast                   # per-op autocast of the model as written
  python examples/gpt.py --compare fp32,bf16-mixed,fp16-mixed   # one chart

The text is the .py files next to the `os` module (Python's own library), read
as ASCII: it exists on every machine with Python, so nothing is downloaded.
The model is `gpt_model.GPT` (next to this file): a pre-norm transformer whose
attention softmax, LayerNorms and loss run in float32 whatever the compute
dtype.

On one device the train step below is written out: scale the loss, take
`jax.grad`, hand the scaled gradients to `tx.update` (which unscales them,
skips the step if any is not finite and adjusts the loss scale), then
`optax.apply_updates`. `--accum`, `--zero1` and several processes use the
library's step instead (`jmp_train.train.make_train_step`), which does the
same per micro-batch and device, and with `--zero1` splits the optimizer
state and the float32 master weights over every device (8 virtual ones in
a lone CPU process).

With `--fp8-params` the FP8 layers' kernels are stored in FP8
(`jmp_train.fp8.Fp8Param`: E4M3 values and a power-of-two scale, 1 byte per
weight): the FP8 matmuls read the stored values, `tx.update` steps their
float32 masters and casts them again, and `--zero1` all-gathers 1 byte per
kernel weight.

Several processes (hosts) run the same script; each joins the run with
`jmp_train.distributed.initialize()` and loads only its own rows of each
batch:

  python -m jmp_train.launch -n 2 --cpu-devices 4 examples/gpt.py --zero1
  srun --nodes=2 --ntasks-per-node=8 --gpus-per-task=1 python examples/gpt.py --zero1

The first starts 2 processes of 4 virtual CPU devices each on this machine;
the second runs under Slurm on 2 nodes of 8 GPUs (one process per GPU).
Both train on the same batches as one process would, and only process 0
writes outputs.

Writes runs/gpt-<preset>/metrics-<preset>.json and curves.png (with --compare:
runs/gpt-compare/, one metrics file per preset and one chart).
"""

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from gpt_model import GPT, VOCAB, cross_entropy
from matplotlib.figure import Figure
from tqdm import tqdm

import jmp_train
from jmp_train import distributed, monitor, train, zero1

ZERO1_DEVICES = 8
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
    "--preset",
    default=None,
    choices=list(jmp_train.PRESETS),
    help="the preset to train (default bf16-mixed)",
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
  p.add_argument(
    "--zero1",
    action="store_true",
    help="ZeRO-1 over every device (in a lone CPU process, "
    f"{ZERO1_DEVICES} virtual ones)",
  )
  p.add_argument(
    "--accum", type=int, default=1, help="micro-batches per step (float32)"
  )
  p.add_argument(
    "--fp8",
    nargs="?",
    const="default",
    choices=list(FP8_RECIPES),
    help="FP8 matmuls (head excluded) with this recipe; alone: the default "
    "recipe; without it: the preset's (FP8 for the fp8 presets only)",
  )
  p.add_argument(
    "--fp8-params",
    action="store_true",
    help="store the FP8 layers' kernels in FP8 (1 byte per weight; ZeRO-1 "
    "all-gathers those bytes); FP8 matmuls with --fp8's recipe, the "
    "preset's, or else the default one",
  )
  p.add_argument(
    "--autocast",
    action="store_true",
    help="per-operation autocast (jmp_train.autocast, Apex O1) of the model "
    "as written, instead of per-module linen.wrap (Apex O2)",
  )
  p.add_argument(
    "--init-scale",
    type=float,
    default=None,
    help="initial loss scale (default 2**15; presets with a dynamic one)",
  )
  p.add_argument(
    "--growth-interval",
    type=int,
    default=None,
    help="finite steps between loss-scale growths (default 50, short to "
    "show it work; presets with a dynamic scale)",
  )
  p.add_argument(
    "--eval-every",
    type=int,
    default=25,
    help="steps between validation losses (and metric fetches)",
  )
  p.add_argument(
    "--text-bytes", type=int, default=2_000_000, help="corpus size"
  )
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="runs", help="output folder")
  args = p.parse_args(argv)
  if args.compare and args.preset is not None:
    p.error("--preset and --compare: --compare names every preset it trains")
  args.preset = args.preset or "bf16-mixed"
  presets = args.compare.split(",") if args.compare else [args.preset]
  for name in presets:
    if name not in jmp_train.PRESETS:
      p.error(f"unknown preset {name!r}; known: {', '.join(jmp_train.PRESETS)}")
  if len(set(presets)) < len(presets):
    p.error(f"--compare names a preset twice: {args.compare}")
  args.presets = presets
  for flag in (
    "steps",
    "batch_size",
    "seq_len",
    "layers",
    "heads",
    "accum",
    "eval_every",
  ):
    if getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be 1 or more")
  if args.d_model % args.heads:
    p.error(
      f"--d-model {args.d_model} must be a multiple of --heads {args.heads} "
      "(each head gets d_model / heads features)"
    )
  if not args.lr > 0 or args.warmup < 0:
    p.error(f"--lr must be > 0 and --warmup >= 0, got {args.lr}, {args.warmup}")
  # The last tenth of the corpus is the validation text: each split must
  # hold a window of --seq-len + 1 characters.
  if args.text_bytes - int(0.9 * args.text_bytes) <= args.seq_len + 1:
    p.error(
      f"--text-bytes {args.text_bytes} is too small for --seq-len "
      f"{args.seq_len}: its last tenth (the validation text) must hold "
      f"{args.seq_len + 2} characters, so give at least "
      f"{10 * (args.seq_len + 2)}"
    )
  dynamic = [
    n
    for n in presets
    if isinstance(
      jmp_train.get_preset(n).loss_scale, jmp_train.DynamicLossScale
    )
  ]
  given = [
    f for f in ("init_scale", "growth_interval") if getattr(args, f) is not None
  ]
  if given and not dynamic:
    p.error(
      f"--{given[0].replace('_', '-')} sets a dynamic loss scale, and no "
      f"preset here ({', '.join(presets)}) has one: leave it out"
    )
  args.init_scale = 2.0**15 if args.init_scale is None else args.init_scale
  if args.growth_interval is None:
    args.growth_interval = 50
  fp8_presets = [n for n in presets if jmp_train.get_preset(n).fp8]
  if args.autocast and (
    args.fp8 not in (None, "off") or args.fp8_params or fp8_presets
  ):
    p.error(
      "--autocast runs the model as written, with no FP8 layers: drop --fp8, "
      f"--fp8-params and fp8 presets ({', '.join(fp8_presets) or 'none'})"
    )
  if args.fp8_params and args.fp8 in ("off", "blockwise"):
    p.error(
      f"--fp8-params with --fp8 {args.fp8}: FP8 params need FP8 matmuls "
      "with one power-of-two scale per kernel; give --fp8 current, "
      "current-pow2, delayed or default (or no --fp8)"
    )
  return args


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


def run_preset(args, preset_name, text, out_dir):
  """One training run; returns its summary (also in metrics-<preset>.json)."""
  split = int(0.9 * len(text))
  train_text, val_text = text[:split], text[split:]
  rng = np.random.default_rng(args.seed)  # the same batches for every preset
  # Every process draws the whole batch's windows (the same global batch
  # whatever the process count) and loads only its rows of it.
  processes, me = jax.process_count(), jax.process_index()
  if args.batch_size % processes:
    raise SystemExit(
      f"--batch-size {args.batch_size} does not split over {processes} "
      "processes; give a multiple of the process count."
    )
  per_process = args.batch_size // processes
  mine = slice(me * per_process, (me + 1) * per_process)

  def windows(source, n, rows=slice(None)):
    """n random windows of seq_len + 1 characters (inputs and targets);
    only those in `rows` are loaded."""
    starts = rng.integers(0, len(source) - args.seq_len - 1, n)
    return np.stack([source[s : s + args.seq_len + 1] for s in starts[rows]])

  val_batches = np.stack([windows(val_text, args.batch_size) for _ in range(4)])

  # Model and optimizer, from the preset.
  preset = jmp_train.get_preset(preset_name)
  if isinstance(preset.loss_scale, jmp_train.DynamicLossScale):
    # The preset's dynamic scale, starting at --init-scale and growing every
    # --growth-interval finite steps.
    loss_scale = dataclasses.replace(
      preset.loss_scale, loss_scale=args.init_scale, period=args.growth_interval
    )
    preset = dataclasses.replace(preset, loss_scale=loss_scale)
  if args.fp8 is not None:
    preset = dataclasses.replace(preset, fp8=FP8_RECIPES[args.fp8])
  elif args.fp8_params and preset.fp8 is None:
    preset = dataclasses.replace(preset, fp8=FP8_RECIPES["default"])
  # Every matmul but the output head in FP8 (an fp8 preset or --fp8); with
  # --fp8-params, `init` stores those matmuls' kernels as FP8 params.
  model = GPT(args.layers, args.d_model, args.heads, args.seq_len)
  if not args.autocast:
    model = jmp_train.linen.wrap(
      model,
      preset.policy,
      fp8=preset.fp8,
      fp8_exclude=("head",),
      fp8_params=args.fp8_params,
    )
  # Under jit: one compilation instead of one per initializer op.
  variables = jax.jit(model.init)(
    jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32)
  )
  apply = model.apply
  if args.autocast:
    # The model as written (float32 layers); each primitive of its apply runs
    # in the precision of autocast's lists, params stored as the preset says.
    apply = jmp_train.autocast(model.apply, preset.policy)
    variables = {"params": preset.policy.cast_to_param(variables["params"])}
  schedule = optax.warmup_cosine_decay_schedule(
    0.0,
    args.lr,
    min(args.warmup, args.steps // 2),
    args.steps,
    end_value=args.lr / 10,
  )
  tx = preset.mixed_precision(
    optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(schedule, b2=0.95, weight_decay=0.1),
    )
  )

  # Where the state lives: one device; or with --zero1 a plan that splits
  # the optimizer state and the float32 masters over every device (of every
  # process); or with several processes and no --zero1, data parallelism.
  plan = None
  if args.zero1 or processes > 1:
    devices = jax.devices()
    if args.zero1 and len(devices) == 1:
      raise SystemExit(
        "--zero1 over 1 device splits nothing: JAX has 1 (in a lone CPU "
        f"process the example makes {ZERO1_DEVICES} unless XLA_FLAGS names a "
        "count, as launch --cpu-devices does; name 2 or more)."
      )
    mesh = jax.make_mesh(
      (len(devices),),
      ("data",),
      axis_types=(jax.sharding.AxisType.Auto,),
      devices=devices,
    )
    plan = zero1.make_plan(
      tx, variables["params"], mesh, zero_stage=1 if args.zero1 else 0
    )
  state = train.TrainState.create(
    params=variables["params"],
    tx=tx,
    fp8=variables.get("fp8_meta"),  # FP8 metadata is not a param
    plan=plan,
  )

  # The train step.
  if plan is None and args.accum == 1:
    # Written out: what every mixed-precision step does.
    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch):
      def scaled_loss(params, fp8_meta):
        variables = {"params": params, "fp8_meta": fp8_meta}
        logits = apply(variables, batch[:, :-1])
        loss = cross_entropy(logits, batch[:, 1:])
        return loss * jmp_train.current_loss_scale(state.opt_state), loss

      # Gradients of the scaled loss; the FP8 metadata's "gradients" are
      # this step's amaxes. JAX gives no gradient for an FP8 param's integer
      # bits: `with_grad_slots` gives each a float slot its gradient lands
      # in, and `grads_of` reads them back (no-ops without --fp8-params).
      (grads, fp8_grads), loss = jax.grad(
        scaled_loss, argnums=(0, 1), has_aux=True, allow_int=True
      )(jmp_train.fp8.with_grad_slots(state.params), state.fp8)
      grads = jmp_train.fp8.grads_of(grads)
      # tx.update steps each FP8 param's float32 master and casts it again.
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      metrics = {"loss": loss, **jmp_train.train_metrics(opt_state)}
      # A skipped step keeps the FP8 scales too.
      fp8_meta = jmp_train.fp8.update(
        state.fp8, fp8_grads, finite=metrics["last_step_finite"]
      )
      state = state.replace(
        step=state.step + 1, params=params, opt_state=opt_state, fp8=fp8_meta
      )
      return state, metrics

  else:
    # The library's step does the same per micro-batch (gradients summed in
    # float32) and per device (reduce-scattered to the ZeRO-1 shards).
    def loss_fn(params, batch, model_state, key):
      # model_state holds the FP8 metadata ("fp8_meta") when there is some.
      logits = apply({"params": params, **model_state}, batch[:, :-1])
      return cross_entropy(logits, batch[:, 1:])

    train_step = train.make_train_step(
      loss_fn, tx, plan=plan, accum_steps=args.accum
    )

  if plan is not None:
    # The global batch from this process's rows: each device gets its own.
    # The validation batches are whole on every process (replicated).
    put = functools.partial(train.global_batch, plan=plan)
    val_batches = jax.make_array_from_process_local_data(
      plan.replicated, val_batches
    )
  else:
    put = jnp.asarray

  @jax.jit
  def val_loss(state, batches):
    def one(batch):
      variables = {"params": state.params, "fp8_meta": state.fp8}
      return cross_entropy(apply(variables, batch[:, :-1]), batch[:, 1:])

    return jnp.mean(jax.lax.map(one, batches))

  # A host warning when the loss scale keeps falling; no sync otherwise.
  alarm = jax.jit(
    lambda opt_state: jnp.any(
      jnp.stack(list(monitor.warn_loss_scale(opt_state).values()))
    )
  )

  # The loop. Metrics stay on the device until an evaluation fetches them.
  initial_scale = float(jmp_train.current_loss_scale(state.opt_state))
  history, evals, pending = [], [], []
  start = time.perf_counter()
  bar = tqdm(
    range(args.steps),
    desc=f"gpt {preset_name}",
    unit="step",
    disable=me != 0,  # one bar, not one per process
  )
  for i in bar:
    state, metrics = train_step(
      state, put(windows(train_text, args.batch_size, mine))
    )
    pending.append({**metrics, "alarm": alarm(state.opt_state)})
    if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
      pending, val = jax.device_get((pending, val_loss(state, val_batches)))
      history += [{k: v.item() for k, v in m.items()} for m in pending]
      pending = []
      evals.append({"step": i + 1, "val_loss": float(val)})
      bar.set_postfix(
        loss=f"{history[-1]['loss']:.3f}",
        val=f"{val:.3f}",
        scale=f"{history[-1]['loss_scale']:g}",
      )
  seconds = time.perf_counter() - start

  # Outputs.
  summary = {
    "preset": preset_name,
    "policy": str(preset.policy),
    "fp8": (
      {"recipe": type(preset.fp8).__name__, **dataclasses.asdict(preset.fp8)}
      if preset.fp8
      else None
    ),
    "config": {k: v for k, v in vars(args).items() if k != "presets"},
    "devices": plan.mesh.size if plan else 1,
    "processes": processes,
    "steps": args.steps,
    "seconds": round(seconds, 2),
    "first_loss": history[0]["loss"],
    "final_val_loss": evals[-1]["val_loss"],
    "skipped_steps": history[-1]["skipped_steps"],
    "final_loss_scale": history[-1]["loss_scale"],
    "initial_loss_scale": initial_scale,
    "param_dtypes": sorted(
      {
        str(p.dtype)  # an FP8 param's: float8_e4m3fn
        for p in jax.tree.leaves(
          state.params, is_leaf=jmp_train.fp8.is_fp8_param
        )
      }
    ),
    "evals": evals,
    "history": history,
  }
  if me == 0:  # every process has the summary; one writes it
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"metrics-{preset_name}.json").write_text(
      json.dumps(summary, indent=1)
    )
    print(
      f"{preset_name}: loss {summary['first_loss']:.3f} -> val "
      f"{summary['final_val_loss']:.3f} in {args.steps} steps, "
      f"{seconds:.1f}s; skipped {summary['skipped_steps']} steps; final "
      f"loss scale {summary['final_loss_scale']:g}"
    )
  return summary


def _smooth(xs, window=10):
  xs = np.asarray(xs, np.float64)
  kernel = np.ones(min(window, len(xs))) / min(window, len(xs))
  return np.convolve(xs, kernel, mode="valid")


def plot(runs, path, title):
  """Train loss (moving average) and val loss; val differences; loss scales."""
  fig = Figure(figsize=(8, 8))
  ax1, ax2, ax3 = fig.subplots(
    3, 1, sharex=True, gridspec_kw={"height_ratios": (3, 1.3, 1.3)}
  )
  styles = ["-", "--", ":", "-."]
  base = runs[0]
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
  ax2.set_ylabel(f"val loss minus\n{base['preset']}'s")
  ax3.set_yscale("log", base=2)
  ax3.set_xlabel("step")
  ax3.set_ylabel("loss scale")
  ax3.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None):
  args = parse_args(argv)
  # Join the other processes when a launcher started several (srun,
  # jmp_train.launch, ...); a lone process goes on alone. Before anything
  # touches a device.
  many = distributed.initialize()
  named = "xla_force_host_platform_device_count" in os.environ.get(
    "XLA_FLAGS", ""
  )
  if args.zero1 and not many and not named:
    # On a CPU, ZeRO-1's devices are virtual; JAX makes them when it starts,
    # so this comes before anything runs (GPUs and TPUs are what they are;
    # a launcher, `launch -n 1 --cpu-devices 4` included, sets each
    # process's CPU devices itself).
    jax.config.update("jax_num_cpu_devices", ZERO1_DEVICES)
  text = load_text(args.text_bytes)
  out_dir = pathlib.Path(args.out) / (
    ("gpt-compare" if args.compare else f"gpt-{args.preset}")
    + ("-autocast" if args.autocast else "")
  )
  runs = [run_preset(args, name, text, out_dir) for name in args.presets]
  mode = []
  if args.zero1:
    mode.append(f"ZeRO-1 x{jax.device_count()}")
  if jax.process_count() > 1:
    mode.append(f"{jax.process_count()} processes")
  if args.accum > 1:
    mode.append(f"accum {args.accum}")
  if args.fp8 not in (None, "off"):
    mode.append(f"fp8 {args.fp8}")
  if args.fp8_params:
    mode.append("fp8 params")
  if args.autocast:
    mode.append("autocast")
  title = (
    f"char GPT ({args.layers}x{args.d_model}, {len(text) / 1e6:.1f} MB of "
    f"stdlib source){', ' + ', '.join(mode) if mode else ''}"
  )
  if jax.process_index() == 0:
    plot(runs, out_dir / "curves.png", title)
    files = ", ".join(f"metrics-{name}.json" for name in args.presets)
    print(f"wrote {files} and curves.png in {out_dir}")
  return runs


if __name__ == "__main__":
  main()

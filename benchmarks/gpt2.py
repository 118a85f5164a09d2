"""GPT-2 small (124M) train steps/s and MFU: plain optax vs jmp_train presets.

Rows, timed side by side in one process (rotated order, median per round):

- plain:      the unwrapped float32 model, a hand-written `jax.grad` +
  `optax.adamw` + `optax.apply_updates` step.
- hand-bf16:  the same step written by hand the way bf16-mixed training is
  done without jmp_train: float32 params cast to bfloat16 inside the loss
  (every matmul in bf16, LayerNorm statistics in float32 as flax computes
  them), loss in float32, no skip.
  bf16-mixed's twin: the ratio between the two is what the wrapper costs.
- fp32, bf16-mixed, bf16-fp8-mixed (or `--presets`): the model under
  `linen.wrap(model, preset.policy, fp8=preset.fp8)` and
  `preset.mixed_precision(optax.adamw)`, stepped by
  `jmp_train.train.make_train_step` on one device (FP8 metadata advances
  inside it).
- autocast bf16-mixed (or `--autocast`): the model as written through
  `jmp_train.autocast(model.apply, preset.policy)` (per-operation casts)
  instead of `linen.wrap`, the same optimizer and step.

With `--torch` it runs instead the same model written in PyTorch with
nanoGPT's recipe (`benchmarks/gpt2_torch.py`: torch.autocast, torch.compile,
fused AdamW, GradScaler for fp16), rows `torch bf16` and `torch fp16`, in a
process of its own; `torch_table` puts them beside bf16-mixed and fp16-mixed.

Every step donates its state.

The model is GPT-2 small: 12 layers, d_model 768, 12 heads, context 1024,
vocabulary 50304 (50257 padded to a multiple of 64), tied embeddings; 124.5M
params. Attention is `jax.nn.dot_product_attention` (cuDNN flash attention on
GPU for bf16/fp16, and in steps compiled for one by `--kernels --target`).
MFU is model FLOPs per second over the device's dense bf16 peak, with
nanoGPT's count: 6 N + 12 L d T FLOPs per token, N the params without the
position embedding.

  python benchmarks/gpt2.py                      # needs a GPU
  python benchmarks/gpt2.py --torch              # the PyTorch side
  python benchmarks/gpt2.py --tiny               # any machine: a smoke run
"""

import argparse
import gzip
import json
import os
import pathlib
import platform
import sys
import time

# The shared GPT model lives with the examples.
sys.path.insert(
  0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)

import device_time
import deviceless
import gpt_model
import gpu_clock
import jax
import jax.numpy as jnp
import md
import numpy as np
import optax
import overhead
import timing

import jmp_train
from jmp_train import train

# The PyTorch twin's autocast dtypes (gpt2_torch.PRECISIONS, which needs torch).
TORCH_PRECISIONS = ("bf16", "fp16")
# Dense bf16 peak FLOP/s (no sparsity), from the vendors' data sheets.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--presets", default="fp32,bf16-mixed,fp16-mixed,bf16-fp8-mixed"
  )
  p.add_argument(
    "--autocast",
    default="bf16-mixed",
    help="presets also run as jmp_train.autocast of the model as written "
    "(rows 'autocast <preset>'); '' for none",
  )
  p.add_argument(
    "--no-plain",
    action="store_true",
    help="leave out the float32 row (ratios are then vs the first row)",
  )
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--steps-per-round", type=int, default=5)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument(
    "--loss",
    choices=("logits", "fused"),
    default="logits",
    help="logits: the model's logits, then cross_entropy; fused: the model"
    " computes the loss off the tied embedding (gpt_model.fused_cross_entropy)",
  )
  p.add_argument("--loss-chunk", type=int, default=4096)
  p.add_argument(
    "--lse",
    choices=("one-pass", "two-pass"),
    default="one-pass",
    help="with --loss logits: the log-sum-exp's passes over the logits"
    " (gpt_model.cross_entropy's one_pass)",
  )
  p.add_argument(
    "--lse-slices",
    type=int,
    default=None,
    help="with --lse one-pass: how many equal parts each row of logits is"
    " cut in, reduced side by side (gpt_model.cross_entropy's slices; a"
    " divisor of the vocabulary; default gcd(vocabulary, 128))",
  )
  p.add_argument(
    "--gelu",
    choices=gpt_model.GELUS,
    default="tanh",
    help="how the model computes its GELU (gpt_model.GPT's gelu), the same"
    " function each: tanh, nn.gelu under a remat; logistic, through the"
    " logistic function under the same remat; epilogue, nn.gelu without the"
    " remat and with a backward pass of its own, which XLA:GPU computes in"
    " fc's GEMM epilogue where the matmul goes to cuBLAS"
    " (--xla_gpu_enable_triton_gemm=false; meant for rows without autocast)",
  )
  p.add_argument(
    "--qkv",
    choices=gpt_model.QKVS,
    default="packed",
    help="the layout of the attention's q, k and v projections"
    " (gpt_model.GPT's qkv): packed, GPT-2's DenseGeneral to (3, heads,"
    " head_dim); dense, one Dense whose bias is a vector; split, three"
    " Denses, which XLA merges back into one unless --xla-flags has"
    " --xla_gpu_dot_merger_threshold_mb=0",
  )
  p.add_argument(
    "--xla-flags",
    default="",
    help="added to XLA_FLAGS before JAX starts its backend (recorded in the"
    " results, shown beside the run's rows)",
  )
  p.add_argument(
    "--tag",
    default="",
    help="a few words shown beside the run's rows (e.g. what code it timed),"
    " to tell it from another run of the same batch, loss and flags",
  )
  p.add_argument("--tiny", action="store_true", help="a small model (CPU)")
  p.add_argument(
    "--torch",
    action="store_true",
    help="time the PyTorch twin instead (benchmarks/gpt2_torch.py)",
  )
  p.add_argument("--torch-precisions", default="bf16,fp16")
  p.add_argument(
    "--no-compile", action="store_true", help="--torch without torch.compile"
  )
  p.add_argument(
    "--kernels",
    action="store_true",
    help="compile each step without running it and count its kernels",
  )
  p.add_argument(
    "--profile",
    default=None,
    metavar="DIR",
    help="after the timing, trace one round of each step into DIR/<step>"
    " (a JAX step's compiled HLO beside it) and say where its device time"
    " goes (benchmarks/device_time.py)",
  )
  p.add_argument(
    "--clocks",
    type=timing.count_arg,
    default=None,
    metavar="MS",
    help="sample the GPU's SM clock, power and power-cap bits with"
    " nvidia-smi every MS milliseconds while the steps are timed"
    " (benchmarks/gpu_clock.py); each row gets its rounds' clock",
  )
  deviceless.add_target_argument(p, "with --kernels: ")
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  # Every check before any work: a lent GPU's run is too scarce to fail late.
  if args.target and not args.kernels:
    p.error(f"--target {args.target} compiles without running: add --kernels")
  if args.kernels and args.torch:
    p.error("--kernels counts the JAX steps' kernels: drop --torch")
  if args.profile and args.kernels:
    p.error("--profile traces the steps it times: drop --kernels")
  if args.clocks and args.kernels:
    p.error("--clocks samples the GPU while steps run: drop --kernels")
  if "" in args.presets.split(","):
    p.error(f"--presets: {args.presets!r} names an empty preset")
  for flag in ("presets", "autocast"):
    for name in filter(None, getattr(args, flag).split(",")):
      try:
        jmp_train.get_preset(name)
      except ValueError as e:
        p.error(f"--{flag}: {e}")
  if args.lse == "two-pass" and args.loss == "fused":
    p.error("--lse two-pass is the logits loss's: drop it or --loss fused")
  if args.lse_slices is not None:
    try:  # the rule cross_entropy applies, at parse time
      gpt_model.checked_slices(args.lse_slices, config(args.tiny)["vocab"])
    except ValueError as e:
      p.error(f"--lse-slices: {e}")
    if args.lse != "one-pass" or args.loss != "logits":
      p.error(
        "--lse-slices cuts the one-pass log-sum-exp's rows: it needs --loss"
        " logits and --lse one-pass"
      )
  changed = [
    f"--{flag.replace('_', '-')} {getattr(args, flag)}"
    for flag in ("lse", "lse_slices", "gelu", "qkv")
    if getattr(args, flag) != p.get_default(flag)
  ]
  if args.torch and changed:
    p.error(
      f"{', '.join(changed)}: --lse, --lse-slices, --gelu and --qkv change"
      " the JAX model, not the PyTorch twin: drop them or --torch"
    )
  if args.loss == "fused" and args.autocast:
    # Under autocast the fused loss's float32 matmuls trace as float32
    # operands and run in the compute dtype: not the fused loss's numerics.
    p.error("--loss fused runs without autocast rows: add --autocast ''")
  for name in args.torch_precisions.split(","):
    if name not in TORCH_PRECISIONS:
      p.error(
        f"--torch-precisions: unknown precision {name!r}; accepted:"
        f" {', '.join(TORCH_PRECISIONS)}"
      )
  return args


def peak_flops(kind: str) -> float | None:
  return gpu_clock.for_kind(PEAK_BF16, kind)


def _ours(results: dict) -> list[dict]:
  """jmp_train's runs (not the PyTorch twin's), by batch then loss."""
  runs = [r for r in results.values() if "rows" in r and "framework" not in r]
  return sorted(runs, key=lambda r: (r["batch"], _run_label(r)))


def _run_label(r: dict) -> str:
  """How a run computed its loss (and its GELU, where not through tanh,
  and its q, k and v projections, where not packed), the XLA flags it set,
  and its tag."""
  flags, tag = r.get("xla_flags"), r.get("tag")
  label = r.get("loss", "logits")
  gelu = r.get("gelu", "tanh")
  if gelu == "epilogue":
    label += ", GELU for fc's epilogue"
  elif gelu != "tanh":
    label += f", GELU via {gelu}"
  if r.get("qkv", "packed") != "packed":
    label += f", q/k/v {r['qkv']}"
  label += f"; XLA_FLAGS {flags}" if flags else ""
  return label + (f"; {tag}" if tag else "")


def _per_wait(r: dict) -> str:
  """How many steps a run dispatched before each wait for the device."""
  n = r.get("steps_per_round")
  return "unsaved steps per wait" if n is None else f"{n} steps per wait"


def _best(runs: list[dict], step: str):
  """The run and row of `step` with the most tokens/s."""
  found = [(r, x) for r in runs for x in r["rows"] if x["step"] == step]
  return max(found, key=lambda rx: rx[1]["tokens_per_s"], default=(None, None))


def table(results: dict) -> str:
  """Steps/s and MFU per step, batch and loss, and the verdict for the
  fastest bf16-mixed run."""
  runs = _ours(results)
  if not runs:
    return md.not_measured("benchmarks/gpt2.py (it needs a GPU)")
  clocked = any(x.get("clock") for r in runs for x in r["rows"])
  # Runs from more than one GPU session may sit side by side: each row then
  # names its device.
  devices = {r["device"] for r in runs}
  rows = [
    [
      x["step"],
      *([r["device"].split(",")[0]] if len(devices) > 1 else []),
      r["batch"],
      r.get("steps_per_round", "n/a"),
      _run_label(r),
      f"{x['ms']:.1f}",
      f"{x['steps_per_s']:.2f}",
      f"{x['tokens_per_s']:,}",
      f"{x['tflops']:.1f}",
      f"{100 * x['mfu']:.1f}%" if x["mfu"] is not None else "n/a",
      md.ratio(x["ratio_vs_plain"]),
      *(_clock_cells(r, x) if clocked else []),
    ]
    for r in runs
    for x in r["rows"]
  ]
  header = ["step", *(["device"] if len(devices) > 1 else []), "batch"]
  header += ["steps per wait", "loss", "ms/step", "steps/s", "tokens/s"]
  g = runs[0]
  peak = g["peak_bf16_tflops"]
  where = g["device"]
  if len(devices) > 1:  # "NVIDIA H100 80GB HBM3 and NVIDIA H200, x86_64"
    kinds, machine = (
      {d.split(",")[0] for d in devices},
      g["device"].split(",")[1:],
    )
    where = ",".join([" and ".join(sorted(kinds)), *machine])
  out = [
    f"{g['model']}, on {where}; "
    + (
      f"MFU over a dense bf16 peak of {peak} TFLOP/s."
      if peak
      else "no bf16 peak known for this device, so no MFU."
    ),
    "",
    md.table(
      [
        *header,
        *("TFLOP/s", "MFU", "vs the run's first row"),
        *(
          ("SM MHz, mean (least-most)", "MFU at that clock") if clocked else ()
        ),
      ],
      rows,
    ),
  ]
  g, mixed = _best(runs, "bf16-mixed")
  if mixed and mixed["mfu"] is not None:
    by_name = {x["step"]: x for x in g["rows"]}
    line = (
      f"Goal (bf16-mixed >= 45% MFU): {100 * mixed['mfu']:.1f}% at"
      f" {_per_wait(g)}, {md.verdict(mixed['mfu'] >= 0.45)}."
    )
    if "hand-bf16" in by_name:
      line += (
        f" bf16-mixed takes {md.ratio(mixed['ms'] / by_name['hand-bf16']['ms'])}"
        " the time of the hand-written bf16 step"
      )
      if "bf16-fp8-mixed" in by_name:
        fp8 = by_name["bf16-fp8-mixed"]["ms"] / mixed["ms"]
        line += f"; bf16-fp8-mixed {md.ratio(fp8)} the bf16-mixed step"
      if "autocast bf16-mixed" in by_name:
        auto = by_name["autocast bf16-mixed"]["ms"] / mixed["ms"]
        line += f"; autocast bf16-mixed {md.ratio(auto)} the bf16-mixed step"
      on = f"{g['device'].split(',')[0]}, " if len(devices) > 1 else ""
      line += f" ({on}batch {g['batch']}, loss {_run_label(g)})."
    out += ["", line + _clock_sentence(g, mixed)]
  return "\n".join(out)


def _clock_cells(r: dict, x: dict) -> list[str]:
  """Row `x`'s SM clock over its timed rounds and its MFU at that clock
  (`gpu_clock.mfu_at_clock`), where run `r` sampled them."""
  c, peak_mhz = x.get("clock"), r.get("peak_clock_mhz")
  if not c:
    return ["n/a", "n/a"]
  mhz = f"{c['sm_mhz_mean']:.0f} ({c['sm_mhz_min']}-{c['sm_mhz_max']})"
  if x["mfu"] is None or not peak_mhz:
    return [mhz, "n/a"]
  return [mhz, f"{100 * gpu_clock.mfu_at_clock(x['mfu'], c, peak_mhz):.1f}%"]


def _clock_sentence(r: dict, x: dict) -> str:
  """What row `x`'s clock says of its MFU, where run `r` sampled it."""
  c, peak_mhz = x.get("clock"), r.get("peak_clock_mhz")
  if not c or not peak_mhz or x["mfu"] is None:
    return ""
  at = gpu_clock.mfu_at_clock(x["mfu"], c, peak_mhz)
  watts = f", {c['watts_mean']:.0f} W" if c["watts_mean"] is not None else ""
  return (
    f" Over its timed rounds the SMs ran at {c['sm_mhz_mean']:.0f} MHz on"
    f" average{watts}, held down for power in"
    f" {100 * c['power_capped_share']:.0f}% of {c['samples']} samples; the"
    f" data sheet's peak is quoted at {peak_mhz} MHz, so at the clock it ran"
    f" the step reached {100 * at:.1f}% of the chip's peak."
  )


def torch_table(results: dict) -> str:
  """jmp_train's bf16-mixed and fp16-mixed tokens/s beside PyTorch's, and
  the verdict for each: per `--torch` run, jmp_train's fastest run on the
  same device, at the same batch and as many steps per wait (a round's
  wait costs the two frameworks differently, so runs that wait at
  different rates are not compared). Any run with the whole logits counts,
  whatever its log-sum-exp, GELU or XLA flags (the same work per step,
  done other ways; its label says which); the fused loss, less work, is a
  row of its own."""
  theirs = [r for r in results.values() if "framework" in r]
  if not theirs:
    return md.not_measured("benchmarks/gpt2.py --torch (it needs a GPU)")
  theirs.sort(key=lambda t: (t["batch"], t.get("steps_per_round") or 0))
  ours = _ours(results)
  return "\n\n".join("\n".join(_torch_block(t, ours)) for t in theirs)


def _torch_block(t: dict, ours: list[dict]) -> list[str]:
  """`torch_table`'s lines for the PyTorch run `t`."""
  out = [
    f"{t['model']}, batch {t['batch']}, {_per_wait(t)}, on {t['device']};"
    f" PyTorch {t['framework'].removeprefix('torch ')}"
    + (", torch.compile" if t["torch_compile"] else ", eager")
    + "."
  ]
  ours = [
    r
    for r in ours
    if r["device"] == t["device"]
    and r["batch"] == t["batch"]
    and r.get("steps_per_round") == t.get("steps_per_round")
  ]
  if not ours:
    return [
      *out,
      "",
      "No jmp_train run on this device at this batch and as many steps per"
      " wait to compare.",
    ]
  counts = {r.get("n_params") for r in ours}
  if counts != {t["n_params"]}:
    known = ", ".join(f"{n:,}" if n else "unknown" for n in counts)
    out.append(
      f"**Not known to be the same model**: {known} params in JAX,"
      f" {t['n_params']:,} in PyTorch."
    )
  theirs_by_name = {x["step"]: x for x in t["rows"]}
  rows, clocks = [], []
  for precision, preset in (("bf16", "bf16-mixed"), ("fp16", "fp16-mixed")):
    b = theirs_by_name.get(f"torch {precision}")
    # The whole-logits loss is nanoGPT's work per step; the fused loss is
    # our model improved, on a row of its own.
    for loss in ("logits", "fused"):
      runs = [r for r in ours if r.get("loss", "logits").startswith(loss)]
      r, a = _best(runs, preset)
      if loss == "fused" and a is None:
        continue
      label = f"{preset}, loss {_run_label(r) if r else loss}"
      if a is None or b is None:
        rows.append([precision, label, "not measured", "", "", ""])
        continue
      ratio = a["tokens_per_s"] / b["tokens_per_s"]
      if a.get("clock") and b.get("clock"):
        clocks.append(
          f"{precision} ({label}): {a['clock']['sm_mhz_mean']:.0f} MHz"
          f" against PyTorch's {b['clock']['sm_mhz_mean']:.0f}"
        )
      rows.append(
        [
          precision,
          label,
          f"{a['tokens_per_s']:,}",
          f"{b['tokens_per_s']:,}",
          md.ratio(ratio),
          md.verdict(ratio >= 1.0),
        ]
      )
  header = ["precision", "jmp_train run", "jmp_train tokens/s"]
  header += ["PyTorch tokens/s", "ratio", "goal >= 1.00x"]
  out += ["", md.table(header, rows)]
  if clocks:  # both sides sampled: did one run at a higher clock?
    out += [
      "",
      "Mean SM clock over the timed rounds: " + "; ".join(clocks) + ".",
    ]
  return out


def kernels_main(args, cfg: dict, steps: dict, tokens, params, topo) -> dict:
  """Each step compiled, not run: its kernels (`overhead.kernel_summary`),
  the bytes they move and how many reduce; with `--target`, for that GPU.
  `params` is the model's float32 params tree; `topo` the target's
  (`deviceless.start`), or None."""
  place = (lambda t: deviceless.abstract(t, topo)) if topo else (lambda t: t)
  kernels = {}
  for name, (step, state) in steps.items():
    start = time.perf_counter()
    hlo = step.lower(place(state), place(tokens)).compile().as_text()
    kernels[name] = overhead.kernel_summary(hlo)
    # Lowering and compiling (one each, this machine; the first step's
    # includes some of JAX's start-up).
    kernels[name]["compile_s"] = round(time.perf_counter() - start, 1)
    print(f"{name}: {kernels[name]}", flush=True)
  return {
    "what": "kernels per step",
    "model": model_line(cfg, sum(x.size for x in jax.tree.leaves(params))),
    "leaves": len(jax.tree.leaves(params)),
    "batch": args.batch,
    "loss": loss_label(args),
    "gelu": args.gelu,
    "qkv": args.qkv,
    "kernels": kernels,
    **deviceless.provenance(args.target),
  }


def kernels_table(results: dict) -> str:
  """Kernels per compiled GPT-2 step, against the hand-written bf16 step."""
  runs = [r for r in results.values() if "kernels" in r]
  if not runs:
    return md.not_measured("benchmarks/gpt2.py --kernels --target h100")
  out = []
  for r in runs:
    k = r["kernels"]
    base = k.get("hand-bf16", next(iter(k.values())))
    rows = [
      [
        name,
        v["total"],
        f"{v['total'] - base['total']:+d}",
        v["reductions"],
        f"{v['reductions'] - base['reductions']:+d}",
        f"{v['mbytes']:,.0f}",
        md.ratio(v["mbytes"] / base["mbytes"]),
        v.get("conditionals", "n/a"),
        v.get("compile_s", "n/a"),
      ]
      for name, v in k.items()
    ]
    header = ["step", "kernels", "vs hand-bf16", "reductions", "vs hand-bf16"]
    header += ["MB moved", "vs hand-bf16", "conditionals", "compile s"]
    out += [
      f"{r['model']} ({r['leaves']} param leaves), batch {r['batch']}, loss"
      f" {_run_label(r)}; {r['device']}, jax {r['jax']}"
      + (f" with {r['cuda_plugin']}" if r.get("cuda_plugin") else "")
      + ".",
      "",
      md.table(header, rows),
    ]
  return "\n".join(out)


def config(tiny: bool) -> dict:
  if tiny:
    return dict(layers=1, d_model=64, heads=4, seq_len=64, vocab=128)
  return dict(layers=12, d_model=768, heads=12, seq_len=1024, vocab=50304)


def model_flops(cfg: dict, batch: int, n_flops: int) -> int:
  """nanoGPT's FLOPs per step: 6 N + 12 L d T per token, `n_flops` (N) the
  params that count (without the position embedding)."""
  seq = cfg["seq_len"]
  per_token = 6 * n_flops + 12 * cfg["layers"] * cfg["d_model"] * seq
  return per_token * batch * seq


def base_model(
  cfg: dict, target: str | None, gelu: str = "tanh", qkv: str = "packed"
) -> gpt_model.GPT:
  """The unwrapped model of `config`, tied, with fused attention, its GELU
  computed as `gelu` says and its q, k and v projections laid out as `qkv`
  says. Compiled for a GPU without one (`target`), the attention is the
  cuDNN kernel the GPU runs, not the XLA one JAX's CPU backend would
  pick."""
  return gpt_model.GPT(
    **cfg,
    tied=True,
    fused_attention=True,
    platform="gpu" if target else None,
    gelu=gelu,
    qkv=qkv,
  )


def timed_rows(
  seconds: dict, cfg: dict, batch: int, n_flops: int, peak, clocks=None
):
  """gpt2.py's row per step from its median seconds per step; `n_flops` the
  params that count (without the position embedding); `clocks` each step's
  SM clock over its rounds (`time_steps`), where sampled."""
  tokens_per_step = batch * cfg["seq_len"]
  flops = model_flops(cfg, batch, n_flops)
  first = next(iter(seconds.values()))
  rows = []
  for name, sec in seconds.items():
    achieved = flops / sec
    rows.append(
      {
        "step": name,
        "ms": round(sec * 1e3, 2),
        "steps_per_s": round(1 / sec, 3),
        "tokens_per_s": round(tokens_per_step / sec),
        "tflops": round(achieved / 1e12, 2),
        "mfu": round(achieved / peak, 4) if peak else None,
        "ratio_vs_plain": round(sec / first, 4),
        **({"clock": clocks[name]} if clocks else {}),
      }
    )
  return rows


def time_steps(args, names, run_round):
  """Median seconds per step of each of `names` (`timing.seconds_per_step`)
  and, with `--clocks`, each one's SM clock over its timed rounds
  (`gpu_clock.summary`; else None)."""
  if not args.clocks:
    seconds = timing.seconds_per_step(
      names, run_round, args.rounds, args.steps_per_round
    )
    return seconds, None
  windows = {name: [] for name in names}

  def timed_round(name):
    start = time.time()
    run_round(name)
    windows[name].append((start, time.time()))

  with gpu_clock.Sampler(args.clocks) as sampler:
    seconds = timing.seconds_per_step(
      names, timed_round, args.rounds, args.steps_per_round
    )
  clocks = {
    n: gpu_clock.summary(sampler.samples, w) for n, w in windows.items()
  }
  return seconds, clocks


def _clock_fields(kind: str, args) -> dict:
  """With `--clocks`, the sampling period and the clock of the data sheet's
  peak for `kind` (`gpu_clock.PEAK_CLOCK_MHZ`), for the MFU at the clock a
  step ran."""
  if not args.clocks:
    return {}
  return {
    "clock_ms": args.clocks,
    "peak_clock_mhz": gpu_clock.peak_clock_mhz(kind),
  }


def saved_then_profiled(args, result: dict, profile, flops_per_step) -> dict:
  """`result` (a run's timings) saved to `args.json`; then, with
  `--profile`, `profile()`'s traces added (with the model's FLOPs per step,
  for the table) and saved again. The timings are saved first: a trace that
  fails keeps them."""
  if args.json:
    md.write_json(args.json, result)
  if args.profile:
    result.update(
      profiles=profile(), flops_per_step=flops_per_step, trace_dir=args.profile
    )
    print(profile_table({"gpt2": result}))
    if args.json:
      md.write_json(args.json, result)
  return result


def _profile_each(args, names, trace) -> dict:
  """Each step's profile: `trace(name, where)` runs one round of
  `args.steps_per_round` steps under a profiler, writing into
  `where` (DIR/<step>), and returns the summary of its trace and the round's
  seconds; the wall time per step is added."""
  out = {}
  for name in names:
    where = pathlib.Path(args.profile) / name.replace(" ", "-")
    found, seconds = trace(name, where)
    found["wall_us_per_step"] = 1e6 * seconds / args.steps_per_round
    out[name] = found
    _print_profile(name, found)
  return out


def profile_steps(args, steps: dict, state: dict, tokens) -> dict:
  """After the timing: one round of each step traced with `jax.profiler`,
  and the trace read against the step's compiled HLO
  (`device_time.summary`). `state` holds each step's live state, and gets
  the state the round leaves. The HLO is the program that ran: lowering and
  compiling again finds it in JAX's cache. It is saved beside the trace, as
  `step.hlo.txt.gz`."""
  on_device = jax.devices()[0].platform != "cpu"
  n = args.steps_per_round

  def trace(name, where):
    step = steps[name][0]
    hlo = step.lower(state[name], tokens).compile().as_text()
    md.write_hlo(where / "step.hlo.txt.gz", hlo)
    s = state[name]
    with jax.profiler.trace(str(where), create_perfetto_trace=True):
      start = time.perf_counter()
      for _ in range(n):
        s, _ = step(s, tokens)
      state[name] = jax.block_until_ready(s)
      seconds = time.perf_counter() - start
    events = overhead.read_trace(where)
    return device_time.summary(events, hlo, n, device=on_device), seconds

  return _profile_each(args, steps, trace)


def _print_profile(name: str, found: dict) -> None:
  by_class = {k: round(v / 1e3, 2) for k, v in found["by_class_us"].items()}
  print(
    f"{name}: traced {found['wall_us_per_step'] / 1e3:.2f} ms/step, device"
    f" busy {found['busy_us_per_step'] / 1e3:.2f} ms, by class (ms) {by_class}",
    flush=True,
  )


def _back_to_back(r: dict, p: dict) -> list[str]:
  """A traced step's device time once the round is under way (its share of
  the kernels' span, `device_time.span_us`) and the MFU at that time, or
  n/a for a profile saved before the span was."""
  span = p.get("span_us_per_step")
  if span is None:
    return ["n/a", "n/a"]
  peak = r.get("peak_bf16_tflops")
  mfu = r["flops_per_step"] / (span * 1e-6) / (peak * 1e12) if peak else None
  return [f"{span / 1e3:.2f}", "n/a" if mfu is None else f"{100 * mfu:.1f}%"]


def _speeds(name: str, p: dict, top: int = 4) -> list[str]:
  """A note of a traced step's `top` longest kernels of XLA's own but its
  matmuls (whose speed is their arithmetic's), with the bytes they move
  (operands and result: an upper bound where a kernel reads a slice) and
  the speed they ran at, or none for a profile without them."""
  xla = [
    k
    for k in p.get("kernels", [])
    if "tb_per_s" in k and k["class"] not in ("matmul", "attention")
  ][:top]
  if not xla:
    return []
  return [
    f"{name}, XLA's longest kernels but its matmuls: "
    + ", ".join(
      f"`{k['name']}` (`{k['label']}`) {k['us'] / 1e3:.3g} ms,"
      f" {k['mbytes']:,.3g} MB at {k['tb_per_s']:.3g} TB/s"
      for k in xla
    )
    + "."
  ]


def _idle(p: dict) -> list[str]:
  """A traced step's idle time: the device's gaps between its kernels
  (span less busy time) and the host's wait at the round's start and end
  (traced time less span), or the two together where no span was saved."""
  wall, busy = p["wall_us_per_step"], p["busy_us_per_step"]
  span = p.get("span_us_per_step")
  if span is None:
    return [f"{(wall - busy) / 1e3:.2f} in all", "n/a"]
  return [f"{(span - busy) / 1e3:.2f}", f"{(wall - span) / 1e3:.2f}"]


def profile_table(results: dict) -> str:
  """Per traced step: its time back to back (the device's, from the round's
  first kernel to its last, per step) and the MFU at it, its device time by
  class of kernel, the device's gaps between kernels and the wait at the
  round's start and end, the model's FLOPs over the matmuls' and
  attention's time alone, and the labels (places in the model) that took
  longest."""
  runs = [r for r in results.values() if r.get("profiles")]
  runs.sort(key=lambda r: ("framework" in r, r["batch"]))  # ours first
  if not runs:
    return md.not_measured("benchmarks/gpt2.py --profile DIR (on a GPU)")
  out = []
  for r in runs:
    rows, notes = [], []
    for name, p in r["profiles"].items():
      ms = {k: v / 1e3 for k, v in p["by_class_us"].items()}
      dense = ms["matmul"] + ms["attention"]
      rows.append(
        [
          name,
          f"{p['wall_us_per_step'] / 1e3:.2f}",
          *_back_to_back(r, p),
          f"{p['busy_us_per_step'] / 1e3:.2f}",
          *(f"{ms[c]:.2f}" for c in device_time.CLASSES),
          *_idle(p),
          f"{r['flops_per_step'] / dense / 1e9:.1f}" if dense else "n/a",
          "n/a"
          if p["found_in_hlo"] is None
          else f"{100 * p['found_in_hlo']:.0f}%",
        ]
      )
      top = list(p["by_label_us"].items())[:6]
      notes.append(
        f"{name}, longest: "
        + ", ".join(f"`{k}` {v / 1e3:.2f} ms" for k, v in top)
        + "."
      )
      notes += _speeds(name, p)
    header = ["step", "traced ms/step", "back to back", "MFU back to back"]
    header += ["device busy", *device_time.CLASSES, "gaps between kernels"]
    header += ["wait at round start and end", "TFLOP/s in matmul+attention"]
    header += ["kernels found in HLO"]
    busy = {n: p["busy_us_per_step"] for n, p in r["profiles"].items()}
    if "hand-bf16" in busy and len(busy) > 1:
      # Steadier from run to run than the timed steps: the device's own time.
      notes.append(
        "Device busy time against the hand-written bf16 step's: "
        + ", ".join(
          f"{n} {md.ratio(us / busy['hand-bf16'])}"
          for n, us in busy.items()
          if n != "hand-bf16"
        )
        + "."
      )
    out += [
      f"{r['model']}, batch {r['batch']}, loss {_run_label(r)}; {r['device']},"
      f" {r.get('framework') or 'jax ' + r['jax']}; ms per step, one round of"
      f" {r['steps_per_round']} steps traced (traces in {r['trace_dir']}).",
      "",
      md.table(header, rows),
      "",
      *notes,
      "",
    ]
  return "\n".join(out).rstrip()


def loss_label(args) -> str:
  if args.loss == "fused":
    return f"fused, chunks of {args.loss_chunk} rows"
  if args.lse == "two-pass":
    return "logits, two-pass LSE"
  if args.lse_slices is not None:
    return f"logits, LSE in {args.lse_slices} slices"
  return "logits"


def model_line(cfg: dict, n_params: int) -> str:
  return (
    f"GPT {cfg['layers']} layers, d_model {cfg['d_model']},"
    f" {cfg['heads']} heads, context {cfg['seq_len']}, vocabulary"
    f" {cfg['vocab']}, tied embeddings; {n_params / 1e6:.1f}M params"
  )


def main_torch(args, cfg: dict) -> dict:
  """The PyTorch twin's rows (benchmarks/gpt2_torch.py), same fields, timed
  as the JAX steps are."""
  import gpt2_torch

  out = gpt2_torch.build(
    cfg, args.batch, args.torch_precisions.split(","), not args.no_compile
  )
  steps, warm_loss = out["steps"], {}
  for name, step in steps.items():
    for _ in range(args.warmup):
      loss = step()
    warm_loss[name] = loss.item()
    print(f"{name}: warm, loss {warm_loss[name]:.3f}", flush=True)

  def run_round(name):
    for _ in range(args.steps_per_round):
      steps[name]()
    out["sync"]()

  seconds, clocks = time_steps(args, list(steps), run_round)
  peak = peak_flops(out["device_kind"])
  result = {
    "framework": f"torch {out['torch']}",
    "torch_compile": out["compiled"],
    "model": model_line(cfg, out["n_params"]),
    "n_params": out["n_params"],
    "batch": args.batch,
    "rounds": args.rounds,
    "steps_per_round": args.steps_per_round,
    "device": f"{out['device_kind']}, {platform.machine()}",
    "peak_bf16_tflops": peak / 1e12 if peak else None,
    "rows": timed_rows(
      seconds, cfg, args.batch, out["n_params_no_pos"], peak, clocks
    ),
    "warm_loss": warm_loss,
    **_clock_fields(out["device_kind"], args),
  }
  for x in result["rows"]:
    print(f"{x['step']}: {x['ms']} ms/step, {x['tokens_per_s']:,} tokens/s")
  return saved_then_profiled(
    args,
    result,
    lambda: profile_torch(args, steps, out["sync"]),
    model_flops(cfg, args.batch, out["n_params_no_pos"]),
  )


def profile_torch(args, steps: dict, sync) -> dict:
  """`profile_steps` for the PyTorch twin: one round of each step under
  torch.profiler, its Chrome trace written to DIR/<step>/trace.json.gz and
  read by `device_time.torch_summary` (kernels by their names)."""
  import torch

  on_device = torch.cuda.is_available()
  activities = [torch.profiler.ProfilerActivity.CPU]
  if on_device:
    activities.append(torch.profiler.ProfilerActivity.CUDA)
  n = args.steps_per_round

  def trace(name, where):
    where.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
      start = time.perf_counter()
      for _ in range(n):
        steps[name]()
      sync()
      seconds = time.perf_counter() - start
    prof.export_chrome_trace(str(where / "trace.json.gz"))  # gzipped
    with gzip.open(where / "trace.json.gz") as f:
      events = json.load(f)["traceEvents"]
    return device_time.torch_summary(events, n, device=on_device), seconds

  return _profile_each(args, steps, trace)


def main(argv=None):
  args = parse_args(argv)
  # Here, not in parse_args: the tests check the GPU jobs' lines on machines
  # without nvidia-smi.
  if args.clocks:
    if not gpu_clock.available():
      raise SystemExit(
        "--clocks reads nvidia-smi, which is not on PATH: drop it"
      )
    try:
      gpu_clock.check()
    except RuntimeError as e:
      raise SystemExit(f"--clocks: {e}") from e
  if args.xla_flags:  # read when the backend starts, not at import
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " " + args.xla_flags
    ).strip()
  topo = deviceless.start(args.target)
  cfg = config(args.tiny)
  if args.torch:
    return main_torch(args, cfg)
  base = base_model(cfg, args.target, args.gelu, args.qkv)
  seq = cfg["seq_len"]
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(
    rng.integers(0, cfg["vocab"], (args.batch, seq + 1)), jnp.int32
  )

  def loss_of(apply, variables, batch):
    """The mean next-token loss of `batch` through `apply` (a model's)."""
    if args.loss == "fused":  # the loss off the tied embedding, chunked
      return apply(variables, batch[:, :-1], batch[:, 1:], args.loss_chunk)
    logits = apply(variables, batch[:, :-1])
    if args.lse == "two-pass":
      return gpt_model.cross_entropy(logits, batch[:, 1:], one_pass=False)
    return gpt_model.cross_entropy(logits, batch[:, 1:], slices=args.lse_slices)

  init_variables = jax.jit(
    lambda m: m.init(jax.random.key(0), tokens[:1, :-1]), static_argnums=0
  )

  # Every step is `state, metrics = step(state, batch)`, donating the state.
  steps = {}
  # plain: hand-written optax step on the unwrapped float32 model.
  adamw = optax.adamw(1e-4)

  def hand_step(cast):
    @jax.jit(donate_argnums=0)
    def step(state, batch):
      params, opt_state = state

      def loss_fn(p):
        return loss_of(base.apply, {"params": cast(p)}, batch)

      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = adamw.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return (params, opt_state), {"loss": loss}

    return step

  params = init_variables(base)["params"]
  if not args.no_plain:
    steps["plain"] = (hand_step(lambda p: p), (params, adamw.init(params)))

  # hand-bf16: every param cast to bf16 in the loss (LayerNorm's too: flax's
  # LayerNorm still reduces in float32; with float32 scale and bias it would
  # return float32 and every matmul after it would promote to float32).
  def to_bf16(tree):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)

  params = init_variables(base)["params"]  # the plain step donates its own
  steps["hand-bf16"] = (hand_step(to_bf16), (params, adamw.init(params)))
  n_params = sum(x.size for x in jax.tree.leaves(params))
  n_flops = n_params - params["pos"].size

  for name in args.presets.split(","):
    preset = jmp_train.get_preset(name)
    model = jmp_train.linen.wrap(base, preset.policy, fp8=preset.fp8)

    def loss_fn(params, batch, model_state, key, model=model):
      variables = {"params": params, **model_state}
      return loss_of(model.apply, variables, batch)

    tx = preset.mixed_precision(optax.adamw(1e-4))
    variables = init_variables(model)
    state = train.TrainState.create(
      params=variables["params"], tx=tx, fp8=variables.get("fp8_meta")
    )
    steps[name] = (train.make_train_step(loss_fn, tx), state)

  # autocast <preset>: the unwrapped model through jmp_train.autocast (per
  # operation, Apex O1) instead of linen.wrap (per module), same optimizer.
  for name in filter(None, args.autocast.split(",")):
    preset = jmp_train.get_preset(name)
    apply = jmp_train.autocast(base.apply, preset.policy)

    def loss_fn(params, batch, model_state, key, apply=apply):
      return loss_of(apply, {"params": params}, batch)

    tx = preset.mixed_precision(optax.adamw(1e-4))
    params = preset.policy.cast_to_param(init_variables(base)["params"])
    state = train.TrainState.create(params=params, tx=tx)
    steps[f"autocast {name}"] = (train.make_train_step(loss_fn, tx), state)

  if args.kernels:
    result = kernels_main(args, cfg, steps, tokens, params, topo)
    print(kernels_table({"gpt2-kernels": result}))
    if args.json:
      md.write_json(args.json, result)
    return result

  state = {}
  for name, (step, s) in steps.items():
    for _ in range(args.warmup):
      s, metrics = step(s, tokens)
    jax.block_until_ready(s)
    state[name] = s
    print(f"{name}: warm, loss {float(metrics['loss']):.3f}")

  def run_round(name):
    step, s = steps[name][0], state[name]
    for _ in range(args.steps_per_round):
      s, _ = step(s, tokens)
    state[name] = jax.block_until_ready(s)

  names = list(steps)
  seconds, clocks = time_steps(args, names, run_round)
  kind = jax.devices()[0].device_kind
  peak = peak_flops(kind)
  result = {
    "model": model_line(cfg, n_params),
    "n_params": n_params,
    "batch": args.batch,
    "rounds": args.rounds,
    "steps_per_round": args.steps_per_round,
    "device": f"{kind}, {platform.machine()}",
    "peak_bf16_tflops": peak / 1e12 if peak else None,
    "rows": timed_rows(seconds, cfg, args.batch, n_flops, peak, clocks),
    **_clock_fields(kind, args),
    "loss": loss_label(args),
    "gelu": args.gelu,
    "qkv": args.qkv,
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    **({"tag": args.tag} if args.tag else {}),
    "ratios_vs": names[0],
    "jax": jax.__version__,
  }
  print(table({"gpt2": result}))
  return saved_then_profiled(
    args,
    result,
    lambda: profile_steps(args, steps, state, tokens),
    model_flops(cfg, args.batch, n_flops),
  )


if __name__ == "__main__":
  main()

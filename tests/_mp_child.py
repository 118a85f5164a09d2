"""The run tests/test_multiprocess.py compares across process counts.

The same functions run in the test's own process (1 process x 8 CPU
devices) and, through `jmp_train.distributed.launch`, in 2 processes x 4
devices (`python tests/_mp_child.py OUT CKPT1`), where each process feeds
its own rows of every batch and writes what it saw to OUT/process-<i>.npz
and .json.
"""

import json
import os
import pathlib
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType

import jmp_train as jmp
from jmp_train import checkpoint, distributed, monitor, train, zero1

STEPS, MORE = 4, 2  # steps before the checkpoint, and after it
BATCH = 16


class Mlp(nn.Module):
  """Two Dense layers as people write them (explicit dtypes), FP8 under
  `linen.wrap`; an extra (10,) bias needs ZeRO padding on 8 devices."""

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(24, dtype=jnp.bfloat16)(x))
    x = nn.Dense(4, dtype=jnp.bfloat16)(x)
    extra = self.param("extra_bias", nn.initializers.ones, (10,))
    return x + 1e-2 * jnp.sum(extra)


MODEL = jmp.linen.wrap(
  Mlp(),
  jmp.get_policy("params=bfloat16,compute=bfloat16"),
  fp8=jmp.fp8.DelayedScaling(amax_history_len=4),
)


def loss_fn(params, batch, model_state, key):
  del key
  y = MODEL.apply({"params": params, **model_state}, batch["x"])
  loss = jnp.mean((y.astype(jnp.float32) - batch["y"]) ** 2)
  # `poison` is 0 except where a test puts an inf: on the rows it is on.
  return loss + jnp.mean(batch["poison"]) * params["extra_bias"][0]


def data():
  """The run's batches; step 2 has an inf on rows 12 and 13, process 1's
  rows (of 2). Built when called: arrays made at import would start JAX
  before `jax.distributed.initialize`."""
  rng = np.random.default_rng(0)
  out = []
  for i in range(STEPS + MORE):
    poison = np.zeros((BATCH,), np.float32)
    if i == 2:
      poison[12:14] = np.inf
    out.append(
      {
        "x": rng.standard_normal((BATCH, 8)).astype(np.float32),
        "y": rng.standard_normal((BATCH, 4)).astype(np.float32),
        "poison": poison,
      }
    )
  return out


def make_tx(rounding=False):
  if rounding:  # no masters: bf16 params rounded stochastically
    return jmp.mixed_precision(
      optax.sgd(0.5), param_update=jmp.StochasticRounding(seed=3)
    )
  return jmp.mixed_precision(
    optax.adamw(3e-3),
    loss_scale=jmp.dynamic_loss_scale(2.0**10, growth_interval=3),
  )


def make_plan(tx, params):
  mesh = jax.make_mesh(
    (jax.device_count(),), ("data",), axis_types=(AxisType.Auto,)
  )
  return zero1.make_plan(tx, params, mesh)


def init_variables():
  return jax.jit(MODEL.init)(jax.random.key(0), jnp.ones((1, 8)))


def local_rows(batch):
  """This process's rows of a global batch (all of it in one process)."""
  n, i = jax.process_count(), jax.process_index()
  rows = slice(i * BATCH // n, (i + 1) * BATCH // n)
  return jax.tree.map(lambda x: np.asarray(x)[rows], batch)


def fetch(tree):
  """Every leaf whole on the host, bf16 as float32 (exact; npz has none),
  PRNG keys as their data. One jitted copy replicates the sharded leaves
  on every device (per-leaf gathers would compile one program each)."""

  def plain(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(
      x.dtype, jax.dtypes.prng_key
    ):
      return jax.random.key_data(x)
    return x

  xs = [plain(x) for x in jax.tree.leaves(tree)]
  spread = [
    i
    for i, x in enumerate(xs)
    if isinstance(x, jax.Array) and not x.is_fully_addressable
  ]
  if spread:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
    everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    copies = jax.jit(lambda t: t, out_shardings=everywhere)(
      [xs[i] for i in spread]
    )
    for i, x in zip(spread, copies, strict=True):
      xs[i] = x.addressable_data(0)
  xs = [np.asarray(x) for x in xs]
  return [x.astype(np.float32) if x.dtype == jnp.bfloat16 else x for x in xs]


def run(state, step, plan, batches, alarm=None):
  """Steps over `batches`, each process feeding its own rows. Returns the
  state, the losses and the loss-scale warnings seen on this process."""
  losses, seen = [], []
  for batch in batches:
    state, metrics = step(state, train.global_batch(local_rows(batch), plan))
    losses.append(float(metrics["loss"]))  # readable on every process
    if alarm is not None:
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alarm(state.opt_state)
        jax.effects_barrier()
      seen += [str(w.message) for w in caught]
  return state, losses, seen


def start(rounding=False):
  """The plan, step and step-0 state of a ZeRO-1 run over every device."""
  tx = make_tx(rounding)
  variables = init_variables()
  plan = make_plan(tx, variables["params"])
  state = train.TrainState.create(
    params=variables["params"], tx=tx, fp8=variables["fp8_meta"], plan=plan
  )
  return tx, plan, train.make_train_step(loss_fn, tx, plan=plan), state


def scratch_run(directory=None):
  """STEPS steps from scratch (an inf at step 2), saved to `directory` when
  given. Returns the tx, plan, step, state, losses and warnings."""
  tx, plan, step, state = start()
  alarm = jax.jit(lambda o: monitor.warn_loss_scale(o, falling_streak=1))
  state, losses, seen = run(state, step, plan, data()[:STEPS], alarm)
  if directory is not None:
    with checkpoint.Checkpointer(directory) as ckpt:
      ckpt.save_state(state, plan=plan)
  return tx, plan, step, state, losses, seen


def target(tx):
  """The run's train state as ShapeDtypeStructs."""
  return jax.eval_shape(
    lambda v: train.TrainState.create(
      params=v["params"], tx=tx, fp8=v["fp8_meta"]
    ),
    jax.eval_shape(init_variables),
  )


def resumed(tx, plan, step, directory):
  """The run resumed from `directory`'s checkpoint (any process count)."""
  with checkpoint.Checkpointer(directory) as ckpt:
    state = ckpt.restore_state(target(tx), plan=plan)
  state, losses, _ = run(state, step, plan, data()[STEPS:])
  return state, losses


def rounding_run():
  """Stochastic rounding into bf16 params, no masters, two steps."""
  _, plan, step, state = start(rounding=True)
  state, _, _ = run(state, step, plan, data()[:2])
  return state


def replicas_agree(tree):
  """Whether every device of this process holds the same replicated
  leaves (across processes the test compares the files)."""
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and x.sharding.is_fully_replicated:
      first = np.asarray(x.addressable_data(0))
      for shard in x.addressable_shards[1:]:
        if not np.array_equal(np.asarray(shard.data), first):
          return False
  return True


def copy(state):
  return jax.jit(lambda s: jax.tree.map(jnp.copy, s))(state)


def caught(fn):
  try:
    fn()
  except Exception as e:  # noqa: BLE001 (the message is what is compared)
    return f"{type(e).__name__}: {e}"
  return None


def main(out, ckpt1):
  distributed.initialize()
  i = jax.process_index()
  arrays, report = {}, {"process": i, "processes": jax.process_count()}
  report["first_local_device"] = str(jax.local_devices()[0])

  # From scratch: STEPS steps, saved through the plan and without one.
  tx, plan, step, state, losses, seen = scratch_run(os.path.join(out, "ck2"))
  logical = zero1.to_logical(plan, state)
  arrays["scratch"] = fetch(logical)
  report["losses"], report["warnings"] = losses, seen
  with checkpoint.Checkpointer(os.path.join(out, "ck2-no-plan")) as ckpt:
    # Process-local copies (on this process's device), the same everywhere.
    local = jax.tree.unflatten(
      jax.tree.structure(logical),
      [
        jnp.asarray(x, y.dtype)
        for x, y in zip(
          arrays["scratch"], jax.tree.leaves(logical), strict=True
        )
      ],
    )
    ckpt.save(STEPS, local.params, local.opt_state)

  # 1 -> 2 processes: the test's checkpoint, through the plan and without.
  state, more = resumed(tx, plan, step, ckpt1)
  arrays["resumed"] = fetch(zero1.to_logical(plan, state))
  report["resumed_losses"] = more
  with checkpoint.Checkpointer(ckpt1) as ckpt:
    numpy_params = jax.tree.map(
      lambda s: np.zeros(s.shape, s.dtype), target(tx).params
    )
    _, params, opt_state = ckpt.restore(numpy_params, tx=tx)
    report["no_plan_devices"] = sorted(
      {
        str(d)
        for x in jax.tree.leaves((params, opt_state))
        for d in x.devices()
      }
    )
    arrays["no_plan"] = fetch((params, opt_state))

  # What must be refused, alike on every process.
  # (On a copy: a step that wrongly ran would donate the state.)
  batch = data()[0]
  report["numpy_batch"] = caught(lambda: step(copy(state), batch))
  report["local_batch"] = caught(
    lambda: step(copy(state), jax.tree.map(jnp.asarray, local_rows(batch)))
  )
  # Params each process built for itself, differently (as a per-process
  # seed would): not one replicated value.
  differing = jax.tree.map(lambda x: x + i, init_variables()["params"])
  report["per_process_params"] = caught(
    lambda: train.TrainState.create(params=differing, tx=tx, plan=plan)
  )
  report["save_differing"] = caught(
    lambda: checkpoint.Checkpointer(os.path.join(out, "ck-bad")).save(
      1, differing, jax.jit(tx.init)(differing)
    )
  )

  report["place_differing"] = caught(
    lambda: zero1.place(plan, train.TrainState.create(params=differing, tx=tx))
  )
  report["save_state_differing"] = caught(
    lambda: checkpoint.Checkpointer(os.path.join(out, "ck-bad2")).save_state(
      train.TrainState.create(params=differing, tx=tx)
    )
  )
  report["uneven_rows"] = caught(
    lambda: train.global_batch({"x": np.zeros((8 + 4 * i, 3))}, plan)
  )
  report["no_plan_batch"] = caught(lambda: train.global_batch(batch))
  report["no_plan_step"] = caught(lambda: train.make_train_step(loss_fn, tx))
  report["other_structure"] = caught(
    lambda: distributed.check_same_on_every_process([0.0] * (i + 1), "a list")
  )
  # save_state and restore_state without a plan: the state whole on every
  # process (the same there), saved once, restored onto each process.
  with checkpoint.Checkpointer(os.path.join(out, "ck2-state")) as ckpt:
    ckpt.save_state(local)
    ckpt.wait()
    back = ckpt.restore_state(target(tx))
  arrays["state_no_plan"] = fetch(back)

  rounded = rounding_run()
  arrays["rounding"] = fetch(rounded)
  report["replicas_agree"] = replicas_agree((state, rounded))

  for name, xs in arrays.items():
    np.savez(os.path.join(out, f"process-{i}-{name}.npz"), *xs)
  with open(os.path.join(out, f"process-{i}.json"), "w") as f:
    json.dump(report, f)


def launch_logs(directory):
  """The tail of each process's log that `distributed.launch(log_dir=)`
  wrote, for a failing test's message."""
  return "\n".join(
    f"--- {p.name}\n{p.read_text()[-3000:]}"
    for p in sorted(pathlib.Path(directory).glob("*.log"))
  )


def mp_timeout_s(one_process_s):
  """A launch's time limit from the same work's one-process time under the
  same load: 60 s plus three times that. A hang fails in minutes; a busy
  CI machine, where a flat 60 s once ran out, does not fail a healthy run."""
  return 60 + 3 * one_process_s


def load(path):
  """A list `main` saved with np.savez."""
  with np.load(path) as f:
    return [f[f"arr_{k}"] for k in range(len(f.files))]


if __name__ == "__main__":
  main(*sys.argv[1:])

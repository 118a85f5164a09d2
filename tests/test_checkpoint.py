"""Orbax checkpoints: round trips, bit-exact resume, resharding, atomicity."""

import glob
import json
import os
import re
import subprocess
import sys

import _ckpt_child
import _models
import flax.linen as nn
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jmp_train as jmp
from jmp_train import checkpoint, train, zero1
from jmp_train import nnx as mp_nnx
from jmp_train._src import checkpoint as checkpoint_src
from jmp_train._src import checkpoint_format, leaves

TESTS = os.path.dirname(__file__)
EXAMPLES = os.path.join(os.path.dirname(TESTS), "examples")  # gpt_model


def _child(*args):
  path = os.pathsep.join([TESTS, EXAMPLES, os.environ.get("PYTHONPATH", "")])
  env = dict(os.environ, PYTHONPATH=path)
  return subprocess.run(
    [sys.executable, os.path.join(TESTS, "_ckpt_child.py"), *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def _assert_trees_equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb, strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _host(state):
  """A train state's leaves as NumPy arrays, the key as its data."""
  if state.key is not None:
    state = state.replace(key=jax.random.key_data(state.key))
  return jax.tree.map(np.asarray, state)


def _logical_opt_state(plan, params, opt_state):
  """The optimizer state without the plan's ZeRO-1 padding."""
  state = train.TrainState(
    step=jnp.int32(0),
    params=params,
    opt_state=opt_state,
    model_state={},
    fp8={},
    key=None,
  )
  return zero1.to_logical(plan, state).opt_state


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """10 ZeRO-1 steps on 8 devices (two skipped), saved as a train state with
  master weights and as params and optimizer state without them, then 10
  more steps."""
  tx = _ckpt_child.make_tx()
  plan = _ckpt_child.make_plan(tx)
  step = _ckpt_child.make_step(tx, plan)
  state = _ckpt_child.initial_state(tx, plan)
  data = _models.batches(20, poison_at=(4, 13))
  for batch in data[:10]:
    state, _ = step(state, batch)
  saved = _host(zero1.to_logical(plan, state))
  root = tmp_path_factory.mktemp("ckpt")
  with checkpoint.Checkpointer(root / "masters=True") as ckpt:
    ckpt.save_state(state, plan=plan)
  with checkpoint.Checkpointer(
    root / "masters=False", use_master_weights_in_ckpt=False
  ) as ckpt:
    ckpt.save(10, state.params, state.opt_state, plan=plan)
  for batch in data[10:]:
    state, metrics = step(state, batch)
  assert int(metrics["skipped_steps"]) == 2
  return root, saved, _ckpt_child.snapshot(state, plan)


def test_resume_in_a_fresh_process_is_bit_exact(trained, tmp_path):
  # 10 steps, save_state, a fresh process restores and trains 10 more: the
  # same bits as 20 uninterrupted steps (params, optimizer state, model
  # state, step and key).
  root, _, final = trained
  out = tmp_path / "resumed.npz"
  result = _child("resume", str(root / "masters=True"), str(out))
  assert result.returncode == 0, result.stderr[-3000:]
  resumed = np.load(out)
  assert len(resumed.files) == len(final)
  for i, leaf in enumerate(final):
    np.testing.assert_array_equal(resumed[f"arr_{i}"], leaf)


@pytest.mark.parametrize("devices", [8, 4, 1])
def test_restore_reshards_onto_other_meshes(trained, devices):
  root, saved, _ = trained
  tx = _ckpt_child.make_tx()
  plan = _ckpt_child.make_plan(tx, devices)
  ckpt = checkpoint.Checkpointer(root / "masters=True")
  state = ckpt.restore_state(_ckpt_child.state_target(tx), plan=plan)
  assert int(state.step) == 10
  _assert_trees_equal(_host(zero1.to_logical(plan, state)), saved)
  for leaf in jax.tree.leaves(state.opt_state):
    if leaf.ndim:
      assert len(leaf.sharding.device_set) == devices
  # restore() reads the same params and optimizer state, laid out alike.
  n, params, opt_state = ckpt.restore(_ckpt_child.param_template(), plan=plan)
  assert n == 10
  _assert_trees_equal((params, opt_state), (state.params, state.opt_state))
  for a, b in zip(
    jax.tree.leaves(opt_state), jax.tree.leaves(state.opt_state), strict=True
  ):
    assert a.sharding == b.sharding
  # The restored state trains on the new mesh.
  step = _ckpt_child.make_step(tx, plan)
  state, metrics = step(state, _models.batches(1, seed=7)[0])
  assert np.isfinite(float(metrics["loss"]))
  assert int(metrics["steps"]) == 11


def _saved_bytes(directory, step):
  """Bytes of the arrays of a checkpoint's params and optimizer state, from
  orbax's metadata (sizes on disk vary with compression and layout)."""
  total = 0
  for item in ("params", "opt_state"):
    path = os.path.join(directory, str(step), item)
    tree = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
    total += sum(
      int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize for m in tree.values()
    )
  return total


def test_without_masters_rebuilds_them_by_upcasting(trained):
  root, saved, _ = trained
  tx = _ckpt_child.make_tx()
  plan = _ckpt_child.make_plan(tx)
  ckpt = checkpoint.Checkpointer(root / "masters=False")
  template = _ckpt_child.param_template()
  _, params, opt_state = ckpt.restore(template, plan=plan)
  _assert_trees_equal(params, saved.params)
  logical = _logical_opt_state(plan, params, opt_state)
  for m, p in zip(
    jax.tree.leaves(logical.master_params), jax.tree.leaves(params), strict=True
  ):
    assert m.dtype == jnp.float32
    np.testing.assert_array_equal(m, np.asarray(p).astype(np.float32))
  # Everything else (moments, loss scale, counters) is restored exactly.
  _assert_trees_equal(
    logical._replace(master_params=None),
    saved.opt_state._replace(master_params=None),
  )
  # The saved arrays shrink by exactly the float32 masters' bytes (the
  # train state's other items are stored apart).
  master_bytes = sum(4 * p.size for p in jax.tree.leaves(params))
  with_masters = _saved_bytes(root / "masters=True", 10)
  assert with_masters - _saved_bytes(root / "masters=False", 10) == master_bytes
  names = ocp.PyTreeCheckpointer().metadata(
    os.path.join(root / "masters=False", "10", "opt_state")
  )
  assert not any("master_params" in k for k in names.item_metadata.tree)


class _Net(nn.Module):
  """Dense layers (FP8 under `linen.wrap(fp8=...)`), BatchNorm and dropout."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
    return nn.Dense(4)(x)


@pytest.mark.parametrize(
  "recipe",
  # Current and blockwise scaling keep the same state (a one-entry history).
  [jmp.fp8.DelayedScaling(amax_history_len=4), jmp.fp8.BlockwiseScaling(4)],
  ids=["delayed", "blockwise"],
)
def test_one_device_resume_with_model_state_fp8_and_key_is_bit_exact(
  tmp_path, recipe
):
  model = jmp.linen.wrap(_Net(), "p=bf16,c=bf16,o=f32", fp8=recipe)

  def loss_fn(params, batch, model_state, key):
    y, new_state = model.apply(
      {"params": params, **model_state},
      batch["x"],
      rngs={"dropout": key},
      mutable=["batch_stats"],
    )
    loss = jnp.mean((y.astype(jnp.float32) - batch["y"]) ** 2)
    return loss, (dict(new_state), {})

  def fresh_tx():
    return jmp.mixed_precision(
      optax.adam(1e-2), loss_scale=jmp.dynamic_loss_scale(2.0**8)
    )

  def create(params, model_state, fp8):
    return train.TrainState.create(
      params=params,
      tx=fresh_tx(),
      model_state=model_state,
      fp8=fp8,
      key=jax.random.key(3),
    )

  rng = np.random.default_rng(0)
  data = [
    {
      "x": rng.standard_normal((8, 6)).astype(np.float32),
      "y": rng.standard_normal((8, 4)).astype(np.float32),
    }
    for _ in range(6)
  ]
  data[4]["x"][0, 0] = np.inf  # a skipped step after the resume
  init = jax.jit(lambda x: model.init(jax.random.key(0), x, False))
  variables = init(data[0]["x"])
  args = (
    variables["params"],
    {"batch_stats": variables["batch_stats"]},
    variables["fp8_meta"],
  )
  state = jax.jit(create)(*args)
  step = train.make_train_step(loss_fn, fresh_tx(), has_aux=True)
  for batch in data[:3]:
    state, _ = step(state, batch)
  saved = _host(state)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save_state(state)
  for batch in data[3:]:
    state, metrics = step(state, batch)
  assert int(metrics["skipped_steps"]) == 1
  # Fresh objects: optimizer, step function, Checkpointer, abstract target.
  target = jax.eval_shape(create, *args)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    resumed = ckpt.restore_state(target)
  _assert_trees_equal(_host(resumed), saved)
  assert resumed.key.dtype == state.key.dtype
  history = jax.tree.leaves(resumed.fp8)[0]
  assert np.any(np.asarray(history) != 1.0)  # scales moved off their start
  step = train.make_train_step(loss_fn, fresh_tx(), has_aux=True)
  for batch in data[3:]:
    resumed, _ = step(resumed, batch)
  _assert_trees_equal(_host(resumed), _host(state))
  # Another history length: refused by its shape, saying where shapes of
  # FP8 metadata come from.
  fp8_meta = jax.tree.map(
    lambda s: jmp.fp8.init_state(
      jmp.fp8.DelayedScaling(amax_history_len=8), calls=len(s.amax)
    ),
    variables["fp8_meta"],
    is_leaf=jmp.fp8.is_fp8_state,
  )
  longer = jax.eval_shape(create, args[0], args[1], fp8_meta)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    with pytest.raises(ValueError, match="its FP8 recipe .amax_history_len"):
      ckpt.restore_state(longer)


def test_restore_state_refuses_a_target_that_differs(tmp_path):
  tx = jmp.mixed_precision(optax.sgd(0.1))
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  state = train.TrainState.create(
    params=params,
    tx=tx,
    model_state={"stats": {"n": jnp.arange(2.0)}},
    key=jax.random.key(0),
  )
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, params, state.opt_state)
    with pytest.raises(ValueError, match="save wrote it, not save_state"):
      ckpt.restore_state(state)
    ckpt.save_state(state.replace(step=jnp.int32(2)))
    with pytest.raises(
      ValueError, match="threefry2x32 PRNG key; the target's key is none"
    ):
      ckpt.restore_state(state.replace(key=None))
    with pytest.raises(ValueError, match="the target's key is key<rbg>"):
      ckpt.restore_state(state.replace(key=jax.random.key(0, impl="rbg")))
    other = {**state.model_state, "other": {"m": jnp.zeros(2)}}
    with pytest.raises(
      ValueError,
      match=r"Checkpoint 2 train .*only in the target \[\"\['model_state'\]"
      r"\['other'\]",
    ):
      ckpt.restore_state(state.replace(model_state=other))
    with pytest.raises(TypeError, match="target must be a jmp_train.train"):
      ckpt.restore_state(params)
    # A train-state checkpoint holds params and opt_state as save() does.
    n, params2, opt_state = ckpt.restore(params, tx=tx)
    assert n == 2
    _assert_trees_equal((params2, opt_state), (params, state.opt_state))
    restored = ckpt.restore_state(state)
    _assert_trees_equal(
      _host(restored), _host(state.replace(step=jnp.int32(2)))
    )


def test_killed_save_keeps_the_last_good_checkpoint(tmp_path):
  result = _child("kill", str(tmp_path), "-")
  assert result.returncode == 9, result.stderr[-3000:]
  leftovers = os.listdir(tmp_path)
  assert any("tmp" in name for name in leftovers), leftovers  # half-written
  ckpt = checkpoint.Checkpointer(tmp_path)
  assert ckpt.all_steps() == [1]
  n, params, _ = ckpt.restore(
    _ckpt_child.param_template(), tx=_ckpt_child.one_device_tx()
  )
  assert n == 1
  _assert_trees_equal(params, _ckpt_child.ramp_params())


def test_a_script_that_exits_right_after_save_keeps_the_checkpoint(tmp_path):
  result = _child("exit", str(tmp_path), "-")
  assert result.returncode == 0, result.stderr[-3000:]
  ckpt = checkpoint.Checkpointer(tmp_path)
  assert ckpt.all_steps() == [1], os.listdir(tmp_path)
  _, params, state = ckpt.restore(
    _ckpt_child.param_template(), tx=_ckpt_child.one_device_tx()
  )
  ramp = _ckpt_child.ramp_params()
  _assert_trees_equal(params, ramp)
  masters = jax.tree.map(lambda p: np.asarray(p).astype(np.float32), ramp)
  _assert_trees_equal(state.master_params, masters)


def test_restore_refuses_a_different_dtype(tmp_path):
  tx = jmp.mixed_precision(optax.adam(1e-3))
  params = {"w": jnp.ones((4, 3), jnp.bfloat16)}
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(0, params, tx.init(params))
  with pytest.raises(
    ValueError, match=r"is bfloat16\[4, 3\], the target wants float32"
  ):
    ckpt.restore({"w": jnp.ones((4, 3), jnp.float32)}, tx=tx)
  with pytest.raises(ValueError, match="exactly one of plan= or tx="):
    ckpt.restore(params)
  ckpt.close()
  with pytest.raises(
    ValueError, match="use_master_weights_in_ckpt must be True"
  ):
    checkpoint.Checkpointer(tmp_path, use_master_weights_in_ckpt="yes")


def test_single_device_round_trip_keeps_dtypes_and_loss_scale(tmp_path):
  tx = jmp.mixed_precision(
    optax.adam(1e-3), loss_scale=jmp.dynamic_loss_scale(2.0**7)
  )
  params = {
    "w": jnp.arange(6.0).reshape(2, 3).astype(jnp.float16),
    "n": jnp.int32(4),
  }
  state = tx.init(params)
  grads = {"w": jnp.full((2, 3), jnp.inf, jnp.float16), "n": jnp.int32(0)}
  _, state = tx.update(grads, state, params)  # a skip: scale 2**6
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(3, params, state)
  _, params2, state2 = ckpt.restore(params, tx=tx)
  ckpt.close()
  _assert_trees_equal(params2, params)
  _assert_trees_equal(state2, state)
  assert float(state2.loss_scaler.loss_scale) == 2.0**6
  assert state2.loss_scaler.min_loss_scale == state.loss_scaler.min_loss_scale


@pytest.mark.parametrize("with_masters", [True, False])
def test_a_checkpoint_with_masked_node_placeholders_restores(
  tmp_path, with_masters
):
  # Until 2026-11-26 a param that keeps no master had an optax.MaskedNode in
  # master_params, where the state now has None. Neither holds an array, so
  # a checkpoint written with the old placeholder holds the same arrays in
  # the same order and restores into today's state.
  tx = jmp.mixed_precision(
    optax.adam(1e-3), loss_scale=jmp.dynamic_loss_scale()
  )
  params = {
    "a": jnp.arange(3.0) + 1,
    "b": (jnp.arange(4.0) / 3).astype(jnp.bfloat16),
  }
  state = tx.init(params)
  grads = {"a": jnp.ones(3), "b": jnp.ones(4, jnp.bfloat16)}
  updates, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, updates)
  assert state.master_params["a"] is None
  old = state._replace(
    master_params={"a": optax.MaskedNode(), "b": state.master_params["b"]}
  )
  with checkpoint.Checkpointer(
    tmp_path, use_master_weights_in_ckpt=with_masters
  ) as ckpt:
    ckpt.save(1, params, old)
    _, params2, state2 = ckpt.restore(params, tx=tx)
  assert jax.tree.structure(state2) == jax.tree.structure(state)
  _assert_trees_equal(params2, params)
  if with_masters:
    _assert_trees_equal(state2, state)
  else:  # rebuilt from the params, by design
    np.testing.assert_array_equal(
      state2.master_params["b"], np.asarray(params["b"], np.float32)
    )
    _assert_trees_equal(state2.inner_state, state.inner_state)


def _tiny(value, tx):
  """bf16 params of one value and the state `tx.init` builds for them."""
  params = {"w": jnp.full((3,), value, jnp.bfloat16)}
  return params, tx.init(params)


def test_rollback_then_resume_replaces_the_abandoned_run(tmp_path, caplog):
  tx = jmp.mixed_precision(optax.sgd(0.1))
  ckpt = checkpoint.Checkpointer(tmp_path)
  for step in range(1, 6):
    ckpt.save(step, *_tiny(step, tx))
  ckpt.close()
  # A resumed process rolls back to step 3 and runs again with new values.
  template = {"w": jax.ShapeDtypeStruct((3,), jnp.bfloat16)}
  ckpt = checkpoint.Checkpointer(tmp_path)
  n, params, _ = ckpt.restore(template, tx=tx, step=3, rollback=True)
  assert n == 3
  np.testing.assert_array_equal(params["w"], np.full(3, 3.0))
  with caplog.at_level("WARNING", logger="jmp_train.checkpoint"):
    ckpt.save(4, *_tiny(40, tx))
    ckpt.save(5, *_tiny(50, tx))
  ckpt.close()
  # One run in the folder: 1..3 from the first, 4..5 from the second.
  ckpt = checkpoint.Checkpointer(tmp_path)
  assert ckpt.all_steps() == [1, 2, 3, 4, 5]
  assert sorted(os.listdir(tmp_path)) == ["1", "2", "3", "4", "5"]
  for step, value in [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50)]:
    n, params, state = ckpt.restore(template, tx=tx, step=step)
    assert n == step
    np.testing.assert_array_equal(params["w"], np.full(3, value, np.float32))
    np.testing.assert_array_equal(
      state.master_params["w"], np.full(3, value, np.float32)
    )
  ckpt.close()
  # The deletion was announced once, naming the steps.
  deleted = [
    r.getMessage() for r in caplog.records if "Deleting" in r.getMessage()
  ]
  assert len(deleted) == 1 and "[4, 5]" in deleted[0], deleted


def test_save_not_above_the_latest_step_raises_and_changes_nothing(tmp_path):
  tx = jmp.mixed_precision(optax.sgd(0.1))
  template = {"w": jax.ShapeDtypeStruct((3,), jnp.bfloat16)}
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(1, *_tiny(1, tx))
  ckpt.save(2, *_tiny(2, tx))
  ckpt.wait()
  listing = sorted(os.listdir(tmp_path))
  for step in (1, 2):  # below and equal to the latest (orbax returns False)
    with pytest.raises(
      ValueError, match=rf"step {step}: the latest .* is step 2"
    ):
      ckpt.save(step, *_tiny(10 * step, tx))
  # A restore of an earlier step alone (to evaluate it) deletes nothing: the
  # next save must still go forward.
  ckpt.restore(template, tx=tx, step=1)
  with pytest.raises(ValueError, match=r"step 2: the latest .*rollback=True"):
    ckpt.save(2, *_tiny(20, tx))
  ckpt.save(3, *_tiny(3, tx))
  ckpt.wait()
  assert ckpt.all_steps() == [1, 2, 3]
  listing = sorted(os.listdir(tmp_path))
  # After a rollback to 1, a step not above 1 deletes nothing either.
  ckpt.restore(template, tx=tx, step=1, rollback=True)
  with pytest.raises(ValueError, match="Cannot save step 1: .*restored step 1"):
    ckpt.save(1, *_tiny(10, tx))
  assert ckpt.all_steps() == [1, 2, 3]
  assert sorted(os.listdir(tmp_path)) == listing
  for step in (1, 2, 3):
    _, params, _ = ckpt.restore(template, tx=tx, step=step)
    np.testing.assert_array_equal(params["w"], np.full(3, step, np.float32))
  ckpt.close()


def test_a_save_that_orbax_does_not_write_raises(tmp_path, monkeypatch):
  tx = jmp.mixed_precision(optax.sgd(0.1))
  ckpt = checkpoint.Checkpointer(tmp_path)
  # orbax's CheckpointManager.save returns False when its own policy skips
  # a step (this Checkpointer never asks it to: simulated here).
  monkeypatch.setattr(ckpt._manager, "save", lambda *a, **k: False)
  with pytest.raises(RuntimeError, match="did not write checkpoint 1"):
    ckpt.save(1, *_tiny(1, tx))
  ckpt.close()


def test_restore_puts_each_of_100k_leaves_in_its_place():
  # The save->restore mapping at a size where leaf indices need six digits:
  # the flat dict save hands to orbax, the same dict handed back in another
  # order (orbax's dict order is its own), and the unflatten restore does. A
  # full orbax round trip of 100k tiny leaves takes about 4 minutes here.
  n = 100_001
  tree = {"layers": [np.int32(i) for i in range(n)]}
  flat = checkpoint_format.flat(tree)
  assert len(flat) == n  # names are unique
  from_orbax = dict(sorted(flat.items(), reverse=True))
  template = {"layers": [np.int32(-1)] * n}
  restored = checkpoint_format.unflat(template, from_orbax)
  np.testing.assert_array_equal(
    np.asarray(restored["layers"]), np.arange(n, dtype=np.int32)
  )


def test_unreadable_data_names_the_step_and_leaf(tmp_path):
  tx = jmp.mixed_precision(optax.sgd(0.1))
  params = {"w": jnp.arange(1000.0).astype(jnp.bfloat16)}  # one params leaf
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(1, params, tx.init(params))
  ckpt.wait()
  data = glob.glob(
    str(tmp_path / "1" / "params" / "ocdbt.process_*" / "d" / "*")
  )
  assert data, sorted(os.listdir(tmp_path / "1" / "params"))
  for path in data:
    open(path, "wb").close()  # truncated
  with pytest.raises(OSError, match=r"Checkpoint 1 .*params\['w'\]") as e:
    ckpt.restore(params, tx=tx)
  assert e.value.__cause__ is not None  # the storage error, chained
  assert "master_params" not in str(e.value)  # opt_state's files are intact
  ckpt.close()


def test_a_zero_padded_state_saved_without_its_plan_does_not_restore(
  tmp_path, monkeypatch
):
  tx = _ckpt_child.make_tx()
  plan = _ckpt_child.make_plan(tx)
  params = _ckpt_child.ramp_params()
  state = train.TrainState.create(params=params, tx=tx, plan=plan)
  padded = [
    jax.tree_util.keystr(path)
    for (path, p), m in zip(
      jax.tree_util.tree_leaves_with_path(params),
      jax.tree.leaves(state.opt_state.master_params),
      strict=True,
    )
    if m.shape != p.shape
  ]
  assert padded  # the 10-wide extra bias is padded to 16 on 8 devices
  ckpt = checkpoint.Checkpointer(tmp_path)
  # Without plan= the padding would be saved: refused, naming the leaf.
  host = jax.device_get((state.params, state.opt_state))
  with pytest.raises(ValueError, match="padded shape a ZeRO-1 plan") as e:
    ckpt.save(1, *host)
  assert any(path[2:-2] in str(e.value) for path in padded), str(e.value)
  with pytest.raises(ValueError, match="padded shape a ZeRO-1 plan"):
    ckpt.save_state(jax.device_get(state))
  assert ckpt.all_steps() == []
  # One written anyway (an earlier jmp_train did) does not restore.
  monkeypatch.setattr(checkpoint_src, "_refuse_padded", lambda p, s: None)
  ckpt.save(1, *host)
  for target in ({"plan": plan}, {"tx": tx}):
    with pytest.raises(ValueError, match=r"wants float32\[.*plan=") as e:
      ckpt.restore(_ckpt_child.param_template(), **target)
    assert any(path in str(e.value) for path in padded), str(e.value)
  # A plan made for other params (a wider bias) is named as the fault, not
  # the checkpoint.
  wider = dict(_ckpt_child.param_template())
  wider["extra_bias"] = jax.ShapeDtypeStruct((14,), jnp.bfloat16)  # 16 too
  other = zero1.make_plan(tx, wider, plan.mesh)
  with pytest.raises(
    ValueError,
    match=r"params\['extra_bias'\] is bfloat16\[10\], .* bfloat16\[14\]",
  ):
    ckpt.restore(_ckpt_child.param_template(), plan=other)
  ckpt.close()


def test_restore_with_tx_keeps_the_params_device(tmp_path):
  device = jax.devices()[3]
  tx = jmp.mixed_precision(optax.adam(1e-3))
  params = jax.device_put(
    {"w": jnp.arange(6.0).reshape(2, 3).astype(jnp.bfloat16)}, device
  )
  state = jax.jit(tx.init)(params)
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(1, params, state)
  _, params2, state2 = ckpt.restore(params, tx=tx)
  ckpt.close()
  _assert_trees_equal(params2, params)
  _assert_trees_equal(state2, state)
  for leaf in jax.tree.leaves((params2, state2)):
    assert leaf.devices() == {device}


def test_an_nnx_optimizer_resumes_bit_for_bit_by_the_readme_recipe(tmp_path):
  """BatchNorm statistics, dropout keys, FP8 metadata and `optimizer.step`
  come back too: the resumed run equals the uninterrupted one."""

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(5, 8, rngs=rngs)
      self.bn = nnx.BatchNorm(8, rngs=rngs)
      self.drop = nnx.Dropout(0.3, rngs=rngs)
      self.l2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))

  preset = jmp.get_preset("bf16-lean")
  tx = preset.mixed_precision(optax.adamw(1e-2))

  def build():
    net = Net(nnx.Rngs(0, dropout=1))
    model = mp_nnx.wrap(net, preset.policy, fp8="current")
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    scale = jmp.current_loss_scale(optimizer.opt_state)
    loss = lambda m: jnp.mean((m(x).astype(jnp.float32) - y) ** 2) * scale  # noqa: E731
    optimizer.update(model, nnx.grad(loss)(model))

  rng = np.random.default_rng(0)
  data = [
    (rng.normal(size=(4, 5)).astype(np.float32), rng.normal(size=(4, 3)))
    for _ in range(4)
  ]
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  values = lambda t: jax.tree.map(lambda v: v.get_value(), t, is_leaf=is_var)  # noqa: E731

  def as_train_state(model, optimizer):  # the README's
    return train.TrainState(
      step=optimizer.step.get_value(),
      params=values(nnx.state(model, nnx.Param)),
      opt_state=values(optimizer.opt_state),
      model_state=values(nnx.state(model, nnx.Not(nnx.Param))),
      fp8={},
      key=None,
    )

  def snapshot(model, optimizer):
    tree = values(nnx.state((model, optimizer)))
    return jax.tree.map(
      lambda x: jax.random.key_data(x) if leaves.is_prng_key(x) else x, tree
    )

  model, optimizer = build()
  for x, y in data[:2]:
    train_step(model, optimizer, x, y)
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save_state(as_train_state(model, optimizer))
  for x, y in data[2:]:
    train_step(model, optimizer, x, y)
  model2, optimizer2 = build()  # a fresh start, then the README's restore
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    state = ckpt.restore_state(as_train_state(model2, optimizer2))
  nnx.update(model2, state.params, state.model_state)
  jax.tree.map(
    lambda v, x: v.set_value(x),
    optimizer2.opt_state,
    state.opt_state,
    is_leaf=is_var,
  )
  optimizer2.step.set_value(state.step)
  for x, y in data[2:]:
    train_step(model2, optimizer2, x, y)
  assert int(state.step) == 2 and int(optimizer2.step.get_value()) == 4
  _assert_trees_equal(snapshot(model2, optimizer2), snapshot(model, optimizer))
  # The params and optimizer state alone restart the batch statistics and
  # the dropout keys: that run differs.
  model3, optimizer3 = build()
  nnx.update(model3, state.params)
  jax.tree.map(
    lambda v, x: v.set_value(x),
    optimizer3.opt_state,
    state.opt_state,
    is_leaf=is_var,
  )
  for x, y in data[2:]:
    train_step(model3, optimizer3, x, y)
  differs = jax.tree.map(
    lambda a, b: not np.array_equal(a, b),
    values(nnx.state(model3, nnx.Param)),
    values(nnx.state(model, nnx.Param)),
  )
  assert any(jax.tree.leaves(differs))


def test_bad_steps_and_settings_raise_naming_the_value(tmp_path):
  tx = jmp.mixed_precision(optax.sgd(0.1))
  params, state = _tiny(1, tx)
  ckpt = checkpoint.Checkpointer(tmp_path)
  for bad in (3.7, -1, True, "4"):  # 3.7 was saved as step 3
    with pytest.raises(
      ValueError, match=rf"step must be .*{re.escape(repr(bad))}"
    ):
      ckpt.save(bad, params, state)
  assert ckpt.all_steps() == []
  ckpt.save(np.int64(2), params, state)
  ckpt.save(jnp.int32(3), params, state)
  assert ckpt.all_steps() == [2, 3]
  with pytest.raises(FileNotFoundError, match=r"step 5 .* steps \[2, 3\]"):
    ckpt.restore(params, tx=tx, step=5)
  ckpt.close()
  with pytest.raises(ValueError, match="max_to_keep must be .* got 0"):
    checkpoint.Checkpointer(tmp_path / "other", max_to_keep=0)


def test_restore_refuses_another_format_or_optimizer(tmp_path):
  tx = jmp.mixed_precision(optax.adam(1e-3))
  params, state = _tiny(1, tx)
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(1, params, state)
  ckpt.save(2, params, state)
  ckpt.wait()
  other = jmp.mixed_precision(optax.sgd(0.1, momentum=0.9))
  with pytest.raises(
    ValueError,
    match=r"only in the target \[\"\.inner_state\[0\]\.trace\['w'\]\"\]",
  ):
    ckpt.restore(params, tx=other)
  meta = tmp_path / "2" / "meta" / "metadata"
  meta.write_text(json.dumps({**json.loads(meta.read_text()), "format": 2}))
  with pytest.raises(ValueError, match="Checkpoint 2 .* format 2"):
    ckpt.restore(params, tx=tx)
  ckpt.close()


def test_a_checkpoint_with_an_extra_hysteresis_tracker_says_why(tmp_path):
  # Earlier versions gave a hysteresis=1 scale a third leaf, as hysteresis=2
  # has: such a checkpoint must not restore, and the error must say why.
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  saver = jmp.mixed_precision(
    optax.sgd(0.1), loss_scale=jmp.dynamic_loss_scale(hysteresis=2)
  )
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    ckpt.save(1, params, saver.init(params))
  target = jmp.mixed_precision(
    optax.sgd(0.1), loss_scale=jmp.dynamic_loss_scale()
  )
  with checkpoint.Checkpointer(tmp_path) as ckpt:
    with pytest.raises(ValueError, match="earlier jmp_train wrote it"):
      ckpt.restore(params, tx=target)


def test_keys_in_model_state_and_an_empty_optimizer_state_round_trip(tmp_path):
  # NNX's nnx.Rngs put typed keys in model_state; optax.sgd has no state
  # leaves (orbax refuses an empty item).
  def build(tx, impl="threefry2x32"):
    return train.TrainState.create(
      params={"w": jnp.arange(3.0)},
      tx=tx,
      model_state={"rngs": {"key": jax.random.key(3, impl=impl), "n": 7}},
    )

  for name, tx in (("adam", optax.adam(0.1)), ("sgd", optax.sgd(0.1))):
    state = build(tx)
    with checkpoint.Checkpointer(tmp_path / name) as ckpt:
      ckpt.save_state(state)
      ckpt.wait()
      for target in (jax.eval_shape(lambda tx=tx: build(tx)), build(tx)):
        got = ckpt.restore_state(target)
        key = got.model_state["rngs"]["key"]
        assert key.dtype == state.model_state["rngs"]["key"].dtype
        np.testing.assert_array_equal(
          jax.random.key_data(key),
          jax.random.key_data(state.model_state["rngs"]["key"]),
        )
        assert int(got.model_state["rngs"]["n"]) == 7
        _assert_trees_equal(got.opt_state, state.opt_state)
      with pytest.raises(
        ValueError, match=r"at model_state leaf rngs/key; the"
      ):
        ckpt.restore_state(jax.eval_shape(lambda tx=tx: build(tx, "rbg")))
  with checkpoint.Checkpointer(tmp_path / "sgd") as ckpt:
    with pytest.raises(
      ValueError, match="opt_state holds no leaves; the target"
    ):
      ckpt.restore_state(jax.eval_shape(lambda: build(optax.adam(0.1))))
  # An earlier jmp_train kept no record of such keys: it says so.
  meta = tmp_path / "adam" / "0" / "meta" / "metadata"
  saved = json.loads(meta.read_text())
  meta.write_text(
    json.dumps({k: v for k, v in saved.items() if k != "model_keys"})
  )
  with checkpoint.Checkpointer(tmp_path / "adam") as ckpt:
    with pytest.raises(ValueError, match="earlier jmp_train, .* rngs/key"):
      ckpt.restore_state(jax.eval_shape(lambda: build(optax.adam(0.1))))

"""Orbax checkpoints: round trips, bit-exact resume, resharding, atomicity."""

import os
import subprocess
import sys

import _ckpt_child
import _models
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jmp_train as jmp
from jmp_train import checkpoint, sharding

TESTS = os.path.dirname(__file__)


def _child(*args):
  env = dict(
    os.environ, PYTHONPATH=TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")
  )
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """10 ZeRO-1 steps on 8 devices (two skipped), saved both ways, then 10 more."""
  step = _ckpt_child.make_step()
  data = _models.batches(20, poison_at=(4, 13))
  params, state = step.init(_models.init_params(jnp.bfloat16))
  for batch in data[:10]:
    params, state, _ = step(params, state, batch)
  saved = jax.tree.map(np.asarray, (params, step.to_logical(state)))
  root = tmp_path_factory.mktemp("ckpt")
  for masters in (True, False):
    ckpt = checkpoint.Checkpointer(
      root / f"masters={masters}", use_master_weights_in_ckpt=masters
    )
    ckpt.save(10, params, state, train_step=step)
    ckpt.close()
  for batch in data[10:]:
    params, state, metrics = step(params, state, batch)
  final = jax.tree.map(np.asarray, (params, step.to_logical(state)))
  assert int(metrics["skipped_steps"]) == 2
  return root, saved, final


def test_resume_in_a_fresh_process_is_bit_exact(trained, tmp_path):
  root, _, final = trained
  out = tmp_path / "resumed.npz"
  result = _child("resume", str(root / "masters=True"), str(out))
  assert result.returncode == 0, result.stderr[-3000:]
  resumed = np.load(out)
  leaves = jax.tree.leaves(final)
  assert len(resumed.files) == len(leaves)
  for i, leaf in enumerate(leaves):
    np.testing.assert_array_equal(
      resumed[f"arr_{i}"], np.asarray(leaf, np.float32)
    )


@pytest.mark.parametrize("devices", [8, 4, 1])
def test_restore_reshards_onto_other_meshes(trained, devices):
  root, (params_saved, state_saved), _ = trained
  mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,))
  step = _ckpt_child.make_step()
  step = sharding.make_train_step(step.loss_fn, step.tx, mesh=mesh)
  template = _models.init_params(jnp.bfloat16)
  ckpt = checkpoint.Checkpointer(root / "masters=True")
  n, params, state = ckpt.restore(template, train_step=step)
  assert n == 10
  _assert_trees_equal(params, params_saved)
  _assert_trees_equal(step.to_logical(state), state_saved)
  for leaf in jax.tree.leaves(state):
    if leaf.ndim:
      assert len(leaf.sharding.device_set) == devices
  # The restored state trains on the new mesh.
  params, state, metrics = step(params, state, _models.batches(1, seed=7)[0])
  assert np.isfinite(float(metrics["loss"]))
  assert int(metrics["steps"]) == 11


def test_without_masters_rebuilds_them_by_upcasting(trained):
  root, (params_saved, state_saved), _ = trained
  step = _ckpt_child.make_step()
  ckpt = checkpoint.Checkpointer(root / "masters=False")
  template = _models.init_params(jnp.bfloat16)
  _, params, state = ckpt.restore(template, train_step=step)
  _assert_trees_equal(params, params_saved)
  logical = step.to_logical(state)
  for m, p in zip(
    jax.tree.leaves(logical.master_params), jax.tree.leaves(params), strict=True
  ):
    assert m.dtype == jnp.float32
    np.testing.assert_array_equal(m, np.asarray(p).astype(np.float32))
  # Everything else (moments, loss scale, counters) is restored exactly.
  _assert_trees_equal(
    logical._replace(master_params=None),
    state_saved._replace(master_params=None),
  )

  def saved_bytes(masters):
    meta = checkpoint.Checkpointer(root / f"masters={masters}")._manager
    meta = meta.item_metadata(10)
    return sum(
      int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize
      for item in ("params", "opt_state")
      for m in meta[item].values()
    )

  # The saved arrays shrink by exactly the float32 masters' bytes. (Counted
  # from orbax's metadata: sizes on disk vary with compression and layout.)
  master_bytes = sum(4 * p.size for p in jax.tree.leaves(params))
  assert saved_bytes(True) - saved_bytes(False) == master_bytes
  keys = ckpt._manager.item_metadata(10)["opt_state"]
  assert not any("master_params" in k for k in keys)


def test_killed_save_keeps_the_last_good_checkpoint(tmp_path):
  result = _child("kill", str(tmp_path), "-")
  assert result.returncode == 9, result.stderr[-3000:]
  leftovers = os.listdir(tmp_path)
  assert any("tmp" in name for name in leftovers), leftovers  # half-written
  step = _ckpt_child.make_step()
  ckpt = checkpoint.Checkpointer(tmp_path)
  assert ckpt.all_steps() == [1]
  n, params, state = ckpt.restore(
    _models.init_params(jnp.bfloat16), train_step=step
  )
  assert n == 1
  _assert_trees_equal(params, _models.init_params(jnp.bfloat16))


def test_restore_refuses_a_different_dtype(tmp_path):
  tx = jmp.mixed_precision(optax.adam(1e-3))
  params = {"w": jnp.ones((4, 3), jnp.bfloat16)}
  ckpt = checkpoint.Checkpointer(tmp_path)
  ckpt.save(0, params, tx.init(params))
  with pytest.raises(
    ValueError, match=r"is bfloat16\[4, 3\], the target wants float32"
  ):
    ckpt.restore({"w": jnp.ones((4, 3), jnp.float32)}, tx=tx)
  with pytest.raises(ValueError, match="exactly one of train_step= or tx="):
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

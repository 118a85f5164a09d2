"""The ZeRO-1 plan on 8 virtual CPU devices: layouts, bytes, collectives."""

import math
import re

import _models
import gpt_model
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_train
from jmp_train import memory, train, zero1


@pytest.mark.parametrize(
  "shape,spec",
  [((37, 16), P()), ((10,), P()), ((7, 13), P()), ((16, 48), P(None, "model")),
   ((8,), P()), ((3,), P()), ((64, 5, 3), P())],
)  # fmt: skip
def test_leaf_layout_bound(shape, spec):
  n = 8
  lay = zero1.leaf_layout(shape, spec, n, "data")
  size = math.prod(shape)
  assert lay.dim is not None
  assert lay.spec[lay.dim] is None  # never a model-sharded dimension
  per_device = lay.padded // n * size // shape[lay.dim]
  # At most ceil(size / n) plus one row of the other dimensions.
  assert per_device <= -(-size // n) + size // shape[lay.dim]
  if any(d % n == 0 for i, d in enumerate(shape) if lay.spec[i] is None):
    assert per_device == size // n  # exact when a free dimension divides


def test_leaf_layout_rejects_data_axis_in_spec():
  with pytest.raises(ValueError, match="data axis 'data'"):
    zero1.leaf_layout((8, 8), P("data", None), 8, "data")


def test_make_plan_refuses_bad_arguments():
  params = _models.init_params()
  with pytest.raises(ValueError, match="zero_stage must be 0 or 1, got 2"):
    zero1.make_plan(_models.tx(), params, _models.mesh(), zero_stage=2)
  with pytest.raises(ValueError, match="data_axis 'batch' is not an axis"):
    zero1.make_plan(_models.tx(), params, _models.mesh(), data_axis="batch")
  with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
    zero1.make_plan(_models.tx(), params, jax.devices())
  with pytest.raises(ValueError, match="param_specs must have the params'"):
    zero1.make_plan(
      _models.tx(), params, _models.mesh(), param_specs={"w": P()}
    )
  # Each spec, by the leaf it is for.
  name = jax.tree_util.keystr(
    jax.tree_util.tree_leaves_with_path(params)[0][0],
    simple=True,
    separator="/",
  )
  for bad, error, why in (
    ("model", TypeError, "must be a PartitionSpec or None, got 'model'"),
    (P("mlp"), ValueError, "'mlp' is not an axis of the mesh"),
    (P("data"), ValueError, "uses the data axis 'data'"),
  ):
    specs = jax.tree_util.tree_unflatten(
      jax.tree.structure(params),
      [bad] + [None] * (len(jax.tree.leaves(params)) - 1),
    )
    with pytest.raises(error, match=f"param_specs leaf '{name}'.*{why}"):
      zero1.make_plan(_models.tx(), params, _models.mesh(), param_specs=specs)


def test_flax_partitioning_boxes_are_refused_with_the_route():
  """Boxed params (nn.with_partitioning) read as no spec would replicate
  the kernel without a word; the message's route shards it."""
  import flax.linen as nn
  from jax.sharding import AxisType

  init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
  layer = nn.Dense(4, kernel_init=init)
  boxed = layer.init(jax.random.key(0), jnp.ones((2, 6)))["params"]
  mesh = jax.make_mesh(
    (4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  with pytest.raises(ValueError, match=r"\['kernel'\] are Flax partitioning"):
    zero1.make_plan(optax.adam(1e-3), boxed, mesh)
  plan = zero1.make_plan(
    optax.adam(1e-3),
    nn.meta.unbox(boxed),
    mesh,
    param_specs=nn.get_partition_spec(boxed),
  )
  assert plan.param_shardings["kernel"].spec == P(None, "model")
  # Boxes placed by jit (Flax's guide) carry their spec in their sharding.
  abstract = jax.eval_shape(layer.init, jax.random.key(0), jnp.ones((2, 6)))
  placed = jax.jit(
    lambda: layer.init(jax.random.key(0), jnp.ones((2, 6))),
    out_shardings=nn.get_sharding(abstract, mesh),
  )()["params"]
  plan = zero1.make_plan(optax.adam(1e-3), placed, mesh)
  assert nn.meta.unbox(plan.param_shardings)["kernel"].spec == P(None, "model")


@pytest.fixture(scope="module")
def bf16_plan():
  tx = _models.tx()
  params = _models.init_params(jnp.bfloat16)
  plan = zero1.make_plan(tx, params, _models.mesh())
  return (
    tx,
    params,
    plan,
    train.TrainState.create(params=params, tx=tx, plan=plan),
  )


def test_zero1_partitions_every_param_leaf_of_the_state(bf16_plan):
  _, params, plan, state = bf16_plan
  opt_state = state.opt_state
  # Masters exist for every bf16 param, sharded like the Adam moments.
  assert len(jax.tree.leaves(opt_state.master_params)) == len(
    jax.tree.leaves(params)
  )
  for leaf, planned in zip(
    jax.tree.leaves(opt_state), jax.tree.leaves(plan.opt_state), strict=True
  ):
    assert leaf.shape == planned.shape and leaf.sharding == planned.sharding
    (shard_shape,) = {s.data.shape for s in leaf.addressable_shards}
    if leaf.ndim == 0:
      assert leaf.sharding.is_fully_replicated
      continue
    spec = planned.sharding.spec
    dim = tuple(spec).index("data")
    expected = list(leaf.shape)
    expected[dim] //= 8
    assert shard_shape == tuple(expected), (leaf.shape, shard_shape)
  # Params stay whole on every device, in bf16.
  for p in jax.tree.leaves(state.params):
    assert p.dtype == jnp.bfloat16
    assert p.sharding.is_fully_replicated


def test_place_and_to_logical_round_trip(bf16_plan):
  tx, params, plan, _ = bf16_plan
  logical = train.TrainState.create(params=params, tx=tx)
  placed = zero1.place(plan, logical)
  back = zero1.to_logical(plan, placed)
  extra = placed.opt_state.master_params["extra_bias"]
  assert extra.shape == (16,)  # 10 entries padded to a multiple of 8
  np.testing.assert_array_equal(extra[10:], 0)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(logical), strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match=r"extra_bias' is float32\[16\]"):
    zero1.place(plan, placed)  # already padded


def test_zero1_shardings_public_function(bf16_plan):
  tx, params, plan, _ = bf16_plan
  shardings = zero1.zero1_shardings(tx, params, _models.mesh())
  specs = [s.spec for s in jax.tree.leaves(shardings)]
  assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(shardings))
  assert sum("data" in tuple(s) for s in specs) == 3 * len(
    jax.tree.leaves(params)
  )  # masters, mu and nu
  assert jax.tree.leaves(shardings) == jax.tree.leaves(plan.opt_state_shardings)


def test_per_device_bytes_follow_the_zero_formula():
  # All dimensions divisible by 8: the table must be exactly 2 + 2 + 12/N
  # bytes per param (bf16 params and grads, fp32 master + Adam).
  model = gpt_model.GPT(layers=2, d_model=64, heads=4, seq_len=32, vocab=128)
  params = gpt_model.init_shapes(model, jnp.bfloat16)
  n_params = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
  tx = jmp_train.get_preset("bf16-true").mixed_precision(optax.adam(1e-3))
  state = jax.eval_shape(
    lambda p: train.TrainState.create(params=p, tx=tx), params
  )

  def loss_fn(params, batch, model_state, key):
    logits = model.apply({"params": params}, batch[:, :-1])
    return gpt_model.cross_entropy(logits, batch[:, 1:])

  for n in (1, 2, 8):
    plan = zero1.make_plan(tx, params, _models.mesh((n,)))
    table = memory.memory_table(plan, state)
    assert table["params"] == 2 * n_params
    assert table["gradients"] == 2 * n_params
    assert table["master_weights"] == 4 * n_params // n
    # Adam's two moments, plus its step count and the scalars of the state.
    assert 0 <= table["optimizer_state"] - 8 * n_params // n < 64
    if n == 8:
      step = train.make_train_step(loss_fn, tx, plan=plan)
      batch = jax.ShapeDtypeStruct(
        (8, 33), jnp.int32, sharding=plan.batch_sharding
      )
      compiled = memory.compiled_memory(
        step, zero1.abstract(plan, state), batch
      )
      assert (
        compiled["argument"] == table["total"] - table["gradients"] + 33 * 4
      )


def _lowered(stage, dtype):
  tx = _models.tx()
  params = _models.init_params(dtype)
  plan = zero1.make_plan(tx, params, _models.mesh(), zero_stage=stage)
  state = jax.eval_shape(
    lambda p: train.TrainState.create(params=p, tx=tx), params
  )
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=plan.batch_sharding
    ),
    _models.batches(1)[0],
  )
  step = train.make_train_step(_models.loss_fn, tx, plan=plan)
  return params, step.lower(zero1.abstract(plan, state), batch)


def test_hlo_reduce_scatter_and_all_gather_bytes():
  stats = {}
  for stage in (0, 1):
    params, lowered = _lowered(stage, jnp.float32)
    text = lowered.compile().as_text()
    stats[stage] = memory.summarize_collectives(
      memory.collective_stats(text, 8)
    )
  n_params = sum(p.size for p in jax.tree.leaves(params))
  zero, dp = stats[1], stats[0]
  n_leaves = len(jax.tree.leaves(params))
  assert zero["reduce-scatter"]["count"] == n_leaves
  assert zero["all-gather"]["count"] == n_leaves
  # Only scalars are all-reduced (loss, per-leaf squared norms, flags).
  assert zero["all-reduce"]["max_elements"] == 1
  assert "reduce-scatter" not in dp and "all-gather" not in dp
  # One all-reduce of the float32 grads: 2 * 4 * n * 7/8 bytes per device.
  assert dp["total_bytes"] >= 2 * 4 * n_params * 7 / 8
  assert zero["total_bytes"] <= 1.05 * dp["total_bytes"]


def test_lowered_reduce_scatter_keeps_bf16():
  # The CPU compiler widens bf16 collectives to f32 after lowering; what the
  # program asks for is in the lowered module.
  params, lowered = _lowered(1, jnp.bfloat16)
  types = re.findall(
    r'"stablehlo.reduce_scatter".*?\}\) : \((tensor<[^>]*>)\)',
    lowered.as_text(),
    re.S,
  )
  assert len(types) == len(jax.tree.leaves(params))
  assert all("bf16" in t for t in types), types

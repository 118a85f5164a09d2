"""Presets: each names the policy, loss scale and param-update rule."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train

EXPECTED = {
  # name: (params, compute, output, loss scale class, FP32 masters kept)
  "fp32": ("float32", "float32", "float32", jmp_train.NoOpLossScale, False),
  "bf16-mixed": (
    "float32",
    "bfloat16",
    "float32",
    jmp_train.NoOpLossScale,
    False,
  ),
  "fp16-mixed": (
    "float32",
    "float16",
    "float32",
    jmp_train.DynamicLossScale,
    False,
  ),
  "bf16-true": (
    "bfloat16",
    "bfloat16",
    "float32",
    jmp_train.NoOpLossScale,
    True,
  ),
  "fp16-true": (
    "float16",
    "float16",
    "float32",
    jmp_train.DynamicLossScale,
    True,
  ),
  "bf16-fp8-mixed": (
    "float32",
    "bfloat16",
    "float32",
    jmp_train.NoOpLossScale,
    False,
  ),
  "fp16-fp8-mixed": (
    "float32",
    "float16",
    "float32",
    jmp_train.DynamicLossScale,
    False,
  ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_contents(name):
  preset = jmp_train.get_preset(name)
  params, compute, output, scale_cls, master = EXPECTED[name]
  assert preset.name == name
  assert preset.policy == jmp_train.get_policy(
    f"params={params},compute={compute},output={output}"
  )
  assert type(preset.loss_scale) is scale_cls
  # Every preset keeps masters for low-precision params; only the *-true
  # presets have any.
  assert preset.param_update == jmp_train.MasterWeights()
  assert (np.dtype(preset.policy.param_dtype).itemsize < 4) is master
  assert preset is jmp_train.get_preset(name)
  if "fp8" in name:  # NeMo's *_with_fp8_mixed, with current scaling
    assert preset.fp8 == jmp_train.fp8.CurrentScaling(
      format="hybrid", power_of_two_scales=False
    )
  else:
    assert preset.fp8 is None


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_optimizer_keeps_masters_exactly_for_low_precision_params(name):
  preset = jmp_train.get_preset(name)
  params = preset.policy.cast_to_param({"w": jnp.ones(3), "i": jnp.int32(1)})
  tx = preset.mixed_precision(optax.sgd(1e-4))
  state = tx.init(params)
  has_master = state.master_params["w"] is not None
  assert has_master == (np.dtype(preset.policy.param_dtype).itemsize < 4)
  scale = jmp_train.current_loss_scale(state)
  grads = {
    "w": (jnp.ones(3) * scale).astype(params["w"].dtype),
    "i": np.zeros((), jax.dtypes.float0),
  }
  updates, state = jax.jit(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  assert new["w"].dtype == params["w"].dtype and int(new["i"]) == 1
  if has_master:
    np.testing.assert_allclose(state.master_params["w"], 1 - 1e-4, rtol=1e-7)
  assert int(jmp_train.train_metrics(state)["skipped_steps"]) == 0


def test_fp16_presets_scale_dynamically_like_torch_defaults():
  scaler = jmp_train.get_preset("fp16-mixed").loss_scale
  assert (scaler.factor, scaler.backoff_factor, scaler.period) == (
    2.0,
    0.5,
    2000,
  )
  assert float(scaler.loss_scale) == 2.0**15 and scaler.hysteresis == 1


def test_unknown_preset_lists_the_known_ones():
  with pytest.raises(ValueError) as err:
    jmp_train.get_preset("bf16")
  for name in EXPECTED:
    assert name in str(err.value)
  assert "'bf16'" in str(err.value)
  with pytest.raises(ValueError, match="Unknown preset"):
    jmp_train.get_preset(None)


def test_presets_adjust_with_dataclasses_replace():
  fp16 = jmp_train.get_preset("fp16-true")
  scale = dataclasses.replace(fp16.loss_scale, period=100)
  fast = dataclasses.replace(fp16, loss_scale=scale)
  # The preset's other loss-scale settings are kept; the named one is not
  # changed.
  assert (scale.period, scale.factor, scale.backoff_factor) == (100, 2.0, 0.5)
  assert float(scale.loss_scale) == 2.0**15 and fp16.loss_scale.period == 2000
  assert fast != fp16 and fast == dataclasses.replace(fp16, loss_scale=scale)
  assert fp16 == jmp_train.get_preset("fp16-true")
  assert {fast: 1, fp16: 2}[fp16] == 2  # hashable: usable as a key
  static = dataclasses.replace(fp16, loss_scale=128.0)  # as mixed_precision
  assert static.loss_scale == jmp_train.StaticLossScale(128.0)
  assert dataclasses.replace(fp16, loss_scale=None).loss_scale == (
    jmp_train.NoOpLossScale()
  )

  # The adjusted preset's optimizer follows it: stochastic rounding, no
  # masters, the loss scale grows after `period` finite steps.
  rounded = dataclasses.replace(
    fast, param_update=jmp_train.StochasticRounding(seed=1)
  )
  tx = rounded.mixed_precision(optax.sgd(1e-3))
  params = {"w": jnp.ones(3, jnp.float16)}
  state = tx.init(params)
  assert state.master_params["w"] is None
  grads = {"w": jnp.ones(3, jnp.float16)}
  update = jax.jit(tx.update)
  for _ in range(100):
    _, state = update(grads, state, params)
  assert float(jmp_train.current_loss_scale(state)) == 2.0**16


def test_preset_fields_are_checked_when_built_or_replaced():
  preset = jmp_train.get_preset("bf16-true")
  bad = {
    "policy": (3, "policy must be a jmp_train.Policy or its string"),
    "loss_scale": ("dynamic", "loss_scale must be"),
    "param_update": (True, "param_update must be .*MasterWeights"),
    "fp8": (3, "fp8 must be a jmp_train.fp8 recipe"),
    "name": (3, "name must be a str"),
  }
  for field, (value, message) in bad.items():
    with pytest.raises(TypeError, match=message):
      dataclasses.replace(preset, **{field: value})
  with pytest.raises(ValueError, match="loss_scale"):
    dataclasses.replace(preset, loss_scale=0.0)
  with pytest.raises(ValueError, match=r"fp8 must be .* got 'hybrid'"):
    dataclasses.replace(preset, fp8="hybrid")
  with pytest.raises(ValueError, match="Unknown dtype 'bf17'"):
    dataclasses.replace(preset, policy="bf17")
  # What wrap takes, a preset takes: a policy string, a recipe's name.
  by_name = dataclasses.replace(preset, policy="p=f32,c=bf16", fp8="delayed")
  assert by_name == dataclasses.replace(
    preset,
    policy=jmp_train.get_policy("p=f32,c=bf16"),
    fp8=jmp_train.fp8.DelayedScaling(),
  )


# The lean presets: bf16 params and compute, less kept beside them. Bytes per
# value of what each keeps, by the written rule: a float32 master 4, an int16
# remainder or bf16 compensation 2; moments float32 4, bfloat16 2, FP8 1 plus
# a float32 scale per 128 values (and a float32 exponent with range
# expansion).
_FP8 = 1 + 4 / 128
LEAN = {
  # name: (param_update, kept beside the param, mu, nu)
  "bf16-remainders": (jmp_train.ParamRemainders(), 2, 4, 4),
  "bf16-lean": (jmp_train.ParamRemainders(), 2, 2, 2),
  "bf16-kahan-lean": (jmp_train.KahanSummation(), 2, 2, 2),
  "bf16-fp8-adam": (jmp_train.ParamRemainders(), 2, _FP8, 2),
  "bf16-sr-lean": (jmp_train.StochasticRounding(seed=0), 0, 2, 2),
  "bf16-sr-fp8-adam": (jmp_train.StochasticRounding(seed=0), 0, _FP8, 2),
  "bf16-sr-coat": (
    jmp_train.StochasticRounding(seed=0),
    0,
    _FP8,
    _FP8 + 4 / 128,
  ),
}


def test_lean_presets_keep_the_bytes_their_rule_says():
  from jmp_train import memory, train

  params = {
    "w": jax.ShapeDtypeStruct((256, 512), jnp.bfloat16),
    "b": jax.ShapeDtypeStruct((3, 128), jnp.bfloat16),
  }
  n = 256 * 512 + 3 * 128

  def table_of(preset):
    tx = preset.mixed_precision(optax.adamw(1e-3))
    state = jax.eval_shape(
      lambda p: train.TrainState.create(params=p, tx=tx), params
    )
    return memory.memory_table(None, state)

  # The scalars (step counts, flags, norm) besides bf16-true's 8 B moments.
  scalars = table_of(jmp_train.get_preset("bf16-true"))["optimizer_state"]
  scalars -= 8 * n
  assert 0 < scalars < 64
  for name, (rule, kept, mu, nu) in LEAN.items():
    preset = jmp_train.get_preset(name)
    assert preset.policy == jmp_train.get_policy("p=bf16,c=bf16,o=f32")
    assert preset.param_update == rule and preset.fp8 is None
    table = table_of(preset)
    assert table["params"] == table["gradients"] == 2 * n, name
    assert table["master_weights"] == kept * n, name
    assert table["optimizer_state"] - scalars == round((mu + nu) * n), name
    if name == "bf16-sr-lean":  # the goal: 8 B/param at N = 1
      assert table["total"] - table["other_state"] - scalars == 8 * n


def test_preset_state_formats_are_read_only():
  preset = jmp_train.get_preset("bf16-fp8-adam")
  with pytest.raises(TypeError):
    preset.state_formats["mu"] = jmp_train.state_format.Float32()
  assert jmp_train.get_preset("bf16-fp8-adam").state_formats["mu"] == (
    jmp_train.state_format.FP8()
  )
  assert hash(preset) == hash(jmp_train.get_preset("bf16-fp8-adam"))

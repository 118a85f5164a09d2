"""Presets: each names the policy, loss scale and master-weights choice."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_train

EXPECTED = {
  # name: (params, compute, output, loss scale class, master weights)
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
  assert preset.master_weights is master
  assert preset is jmp_train.get_preset(name)
  if "fp8" in name:  # NeMo's *_with_fp8_mixed: Transformer Engine's defaults
    assert preset.fp8 == jmp_train.fp8.Fp8Recipe(
      format="hybrid", margin=0, amax_history_len=1024, amax_compute_algo="max"
    )
  else:
    assert preset.fp8 is None


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_optimizer_keeps_masters_exactly_for_low_precision_params(name):
  preset = jmp_train.get_preset(name)
  params = preset.policy.cast_to_param({"w": jnp.ones(3), "i": jnp.int32(1)})
  tx = preset.mixed_precision(optax.sgd(1e-4))
  state = tx.init(params)
  has_master = not isinstance(state.master_params["w"], optax.MaskedNode)
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

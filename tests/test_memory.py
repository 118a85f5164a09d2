"""The memory table against the compiled step, and the HLO collective parser."""

import math
import pathlib
import subprocess
import sys

import _child_env
import gpt_model
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import jmp_train
from jmp_train import memory, train, zero1

ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = gpt_model.CONFIGS["tiny-gpt"]


@pytest.fixture(scope="module")
def tiny_gpt():
  # fp16-true on a 2-D mesh: fp16 params and fp32 masters; the tiny model's
  # dimensions (vocab 96) divide 4, so nothing is padded. (bf16 params on a
  # mesh with a model axis crash the XLA:CPU compiler; see README, Limits.)
  preset = jmp_train.get_preset("fp16-true")
  model = jmp_train.linen.wrap(gpt_model.GPT(**CFG), preset.policy)
  params = gpt_model.init_shapes(
    gpt_model.GPT(**CFG), preset.policy.param_dtype
  )
  tx = preset.mixed_precision(optax.adamw(1e-4))
  mesh = jax.make_mesh(
    (4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  plan = zero1.make_plan(tx, params, mesh)
  state = jax.eval_shape(
    lambda p: train.TrainState.create(params=p, tx=tx), params
  )

  def loss_fn(params, tokens, model_state, key):
    logits = model.apply({"params": params, **model_state}, tokens[:, :-1])
    return gpt_model.cross_entropy(logits, tokens[:, 1:])

  n = sum(math.prod(p.shape) for p in jax.tree.leaves(params))
  return plan, state, loss_fn, tx, n


def test_table_matches_the_compiled_step(tiny_gpt):
  plan, state, loss_fn, tx, n = tiny_gpt
  table = memory.memory_table(plan, state)
  assert table["params"] == 2 * n and table["gradients"] == 2 * n
  assert table["master_weights"] == 4 * n // 4  # float32, 1/4 per device
  # AdamW's two float32 moments, split 4 ways, plus a few scalars.
  assert 2 * 4 * n // 4 < table["optimizer_state"] < 2 * 4 * n // 4 + 256
  assert table["other_state"] == 4  # the int32 step: no model state or key
  assert table["total"] == sum(v for k, v in table.items() if k != "total")

  step = train.make_train_step(loss_fn, tx, plan=plan)
  batch = jax.ShapeDtypeStruct((8, CFG["seq_len"] + 1), jnp.int32)
  compiled = memory.compiled_memory(step, zero1.abstract(plan, state), batch)
  batch_bytes = math.prod(plan.batch_sharding.shard_shape(batch.shape)) * 4
  assert compiled["argument"] == table["total"] - table["gradients"] + (
    batch_bytes
  )


def test_table_counts_the_accumulation_buffer_in_its_dtype(tiny_gpt):
  plan, state, _, _, n = tiny_gpt
  table = memory.memory_table(plan, state, accum_steps=2)
  assert table["gradients"] == 4 * n and table["params"] == 2 * n
  bf16 = memory.memory_table(
    plan, state, accum_steps=2, accum_dtype=jnp.bfloat16
  )
  assert bf16["gradients"] == 2 * n  # half the float32 buffer
  assert bf16["total"] == table["total"] - 2 * n
  with pytest.raises(ValueError, match="accum_dtype must be jnp.float32 or"):
    memory.memory_table(plan, state, accum_steps=2, accum_dtype=jnp.float16)


def test_table_refuses_a_state_of_another_optimizer(tiny_gpt):
  plan, state, *_ = tiny_gpt
  other = jax.eval_shape(
    lambda p: train.TrainState.create(params=p, tx=optax.sgd(0.1)),
    state.params,
  )
  with pytest.raises(ValueError, match="state.opt_state"):
    memory.memory_table(plan, other)


def test_one_device_table_counts_whole_leaves():
  tx = jmp_train.mixed_precision(optax.adam(1e-3))
  params = {"w": np.zeros((3, 5), jnp.bfloat16), "b": np.zeros(5, np.float32)}
  state = train.TrainState.create(params=params, tx=tx, key=jax.random.key(0))
  table = memory.memory_table(None, state)
  assert table["params"] == 15 * 2 + 5 * 4
  assert table["master_weights"] == 15 * 4  # only the bfloat16 leaf's
  assert table["other_state"] == 4 + 8  # step and key


def test_collective_parser_on_hlo_lines():
  text = "\n".join(
    [
      "  %rs = f32[4,8]{1,0} reduce-scatter(f32[32,8]{1,0} %g), "
      "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
      "  %ag = bf16[32,8]{1,0} all-gather(bf16[4,8]{1,0} %p), "
      "replica_groups=[1,8]<=[8], dimensions={0}",
      "  %ar = (f32[], f32[]) all-reduce(f32[] %a, f32[] %b), "
      "replica_groups={{0,1,2,3,4,5,6,7}}",
    ]
  )
  found = memory.collective_stats(text, 8)
  kinds = [c.kind for c in found]
  assert kinds == ["reduce-scatter", "all-gather", "all-reduce"]
  rs, ag, ar = found
  assert rs.shape_bytes == 32 * 8 * 4 and rs.bytes == 32 * 8 * 4 * 7 / 8
  assert ag.shape_bytes == 32 * 8 * 2 and ag.group_size == 8
  assert ar.bytes == 2 * 8 * 7 / 8 and ar.max_elements == 1


def test_collective_parser_on_the_async_forms_and_narrow_types():
  # XLA:GPU's async forms, as XLA prints them: an all-gather-start's and a
  # collective-permute-start's results hold their input buffers (and
  # contexts) beside the output; only the output arrives.
  groups = "replica_groups={{0,1,2,3,4,5,6,7}}"
  text = "\n".join(
    [
      "  %ag = (bf16[128]{0}, bf16[1024]{0}) all-gather-start(bf16[128]{0} "
      f"%p), channel_id=1, {groups}, dimensions={{0}}",
      "  %agd = bf16[1024]{0} all-gather-done((bf16[128]{0}, bf16[1024]{0}) "
      "%ag)",
      "  %ag2 = ((f32[2,3]{1,0}, u16[4]{0}), (f32[16,3]{1,0}, u16[32]{0})) "
      f"all-gather-start(f32[2,3]{{1,0}} %a, u16[4]{{0}} %b), {groups}",
      "  %cp = (f32[256]{0}, f32[256]{0}, u32[], u32[]) "
      "collective-permute-start(f32[256]{0} %r), channel_id=3, "
      "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
      "  %rs = ((bf16[4096]{0}), bf16[512]{0}) reduce-scatter-start("
      f"bf16[4096]{{0}} %y), {groups}, dimensions={{0}}, to_apply=%add",
      "  %a2a = ((f32[8,4]{1,0}), f32[8,4]{1,0}) all-to-all-start(f32[8,4]"
      f"{{1,0}} %q), {groups}, dimensions={{0}}",
      f"  %u = s4[512]{{0}} all-gather(s4[64]{{0}} %s), {groups}",
      f"  %c = c64[8]{{0}} all-reduce(c64[8]{{0}} %z), {groups}",
    ]
  )
  ag, ag2, cp, rs, a2a, s4, c64 = memory.collective_stats(text, 8)
  assert (ag.kind, ag.shape_bytes, ag.bytes) == ("all-gather", 2048, 1792)
  assert ag2.shape_bytes == 16 * 3 * 4 + 32 * 2 and ag2.max_elements == 48
  assert (cp.kind, cp.shape_bytes, cp.bytes) == (
    "collective-permute",
    1024,
    1024,
  )
  assert cp.group_size == 4  # the devices of its pairs, not all 8
  # ((inputs), output): the input the reduce-scatter splits is 8 outputs.
  assert (rs.shape_bytes, rs.bytes) == (8192, 8192 * 7 / 8)
  assert (a2a.shape_bytes, a2a.bytes) == (128, 128 * 7 / 8)
  assert (s4.shape_bytes, s4.bytes) == (256, 256 * 7 / 8)  # half a byte each
  assert c64.shape_bytes == 64 and c64.bytes == 2 * 64 * 7 / 8
  for bad, error in ((0, ValueError), (2.0, TypeError)):
    with pytest.raises(error, match="num_devices must be"):
      memory.collective_stats(text, bad)


def test_memory_table_script():
  # A script of its own (it configures JAX's devices), so a child process.
  script = str(ROOT / "benchmarks" / "memory_table.py")
  env = _child_env.child_env()
  args = ["--model", "tiny-gpt", "--preset", "fp16-true", "--mesh"]
  done = subprocess.run(
    [sys.executable, script, *args, "data=4,model=2"],
    capture_output=True,
    text=True,
    env=env,
    check=True,
  )
  lines = dict(line.split(None, 1) for line in done.stdout.splitlines()[1:])
  assert lines["params"].endswith("2.000 B/param")
  assert lines["master_weights"].endswith("1.000 B/param")  # 4 bytes / 4
  bad = subprocess.run(
    [sys.executable, script, "--mesh", "data8"], capture_output=True, text=True
  )
  assert bad.returncode and "--mesh wants name=size" in bad.stderr

"""Proof that FP8 ran: `jmp_train.fp8.check_fp8`, `matmuls`, `compiled_matmuls`.

The references are written rules: which layers a model asks to run in FP8
(by hand from its code and `fp8_exclude`), how many matmuls each has in each
pass (one forward; dx and dw backward, and the forward again under remat),
and what a QDQ pattern or an excluded layer multiplies in.
"""

import flax.linen as nn
import flax.nnx as nnx
import flax.struct
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jmp_train
from jmp_train import fp8

X = jax.ShapeDtypeStruct((2, 8), jnp.float32)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(8)(x)


class Layer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.relu(nn.Dense(8)(x)), None


class Net(nn.Module):
  """Names that collide ("Dense_0" at the top and in Block_0), a scanned
  remat'd stack, an einsum and a head, with `dtype` fields as Flax's
  examples pass them."""

  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, dtype=self.dtype)(x)  # Dense_0
    x = Block()(x)  # Block_0/Dense_0
    stack = nn.scan(
      nn.remat(Layer),
      variable_axes={"params": 0, "fp8_meta": 0},
      split_rngs={"params": True},
      length=2,
    )
    x = stack(name="stack")(x, None)[0]  # stack/Dense_0
    x = nn.Einsum((8, 8), "bi,io->bo", name="mix", dtype=self.dtype)(x)
    return nn.Dense(4, name="head", dtype=self.dtype)(x)


ASKED = {"Dense_0", "stack/Dense_0", "mix"}  # Block_0 and head excluded


def _setup(recipe, net=None, exclude=("head", "Block_0")):
  model = jmp_train.linen.wrap(
    net or Net(), "p=f32,c=bf16,o=f32", fp8=recipe, fp8_exclude=exclude
  )
  v = jax.eval_shape(model.init, jax.random.key(0), X)

  def loss(params, meta, x):
    out = model.apply({"params": params, "fp8_meta": meta}, x)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  return model, v, loss


RECIPES = {
  "delayed": fp8.DelayedScaling(amax_history_len=4),
  "current": fp8.CurrentScaling(),
  "blockwise": fp8.BlockwiseScaling(block_size=4),
}


# dot_general sites per FP8 GEMM: one, or for blockwise scaling the first
# K block's and the scan body's over the other blocks (K = 8, blocks of 4).
SITES = {"delayed": 1, "current": 1, "blockwise": 2}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_asked_layer_runs_in_fp8_in_both_passes(name, variant):
  _, v, loss = _setup(RECIPES[name])
  assert set(fp8.fp8_layers(v)) == ASKED
  step = variant(jax.grad(loss, (0, 1)))
  summary = fp8.check_fp8(step, v["params"], v["fp8_meta"], X)
  # One GEMM forward; dx and dw backward; the remat'd stack recomputes its
  # forward GEMM in the backward pass. A scanned body counts once.
  n = SITES[name]
  assert summary == {
    "Dense_0": {"forward": n, "backward": 2 * n},
    "stack/Dense_0": {"forward": n, "backward": 3 * n},
    "mix": {"forward": n, "backward": 2 * n},
  }


def test_a_forward_only_function_needs_no_backward_pass():
  _, v, loss = _setup(RECIPES["current"])
  summary = fp8.check_fp8(loss, v["params"], v["fp8_meta"], X)
  assert {k: s["backward"] for k, s in summary.items()} == dict.fromkeys(
    ASKED, 0
  )
  with pytest.raises(ValueError, match="no FP8 matmul in the backward pass"):
    fp8.check_fp8(loss, v["params"], v["fp8_meta"], X, backward=True)


def test_matmuls_reports_paths_dtypes_and_passes():
  _, v, loss = _setup(RECIPES["delayed"])
  found = fp8.matmuls(jax.grad(loss, (0, 1)), v["params"], v["fp8_meta"], X)
  e4, e5, bf = "float8_e4m3fn", "float8_e5m2", "bfloat16"

  def at(path):
    return sorted((m.dtypes, m.backward) for m in found if m.path == path)

  # Paths start at wrap's root module and the field holding the model.
  assert all(m.path.startswith("_Wrapped/module/") for m in found)
  # Hybrid: E4M3 forward, the E5M2 gradient times an E4M3 operand backward.
  assert at("_Wrapped/module/Dense_0/Fp8DotGeneral_0") == [
    ((e4, e4), False),
    ((e5, e4), True),
    ((e5, e4), True),
  ]
  # The excluded layers multiply in the compute dtype.
  plain = [((bf, bf), False)] + [((bf, bf), True)] * 2
  assert at("_Wrapped/module/Block_0/Dense_0") == plain
  assert at("_Wrapped/module/head") == plain
  assert all(m.fp8 == (bf not in m.dtypes) for m in found)


class QdqDot(nn.Module):
  """Flax's old `Fp8DotGeneralOp` without a GPU: FP8 state, and a
  quantize-dequantize of each operand before a dot in the input dtype,
  which only a compiler pattern-match could turn into an FP8 GEMM."""

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, **kwargs):
    self.variable(fp8.COLLECTION, "fp8", fp8.init_state, fp8.CurrentScaling())

    def qdq(x):
      return x.astype(jnp.float8_e4m3fn).astype(x.dtype)

    return lax.dot_general(qdq(lhs), qdq(rhs), dimension_numbers)


class LoraDense(nn.Dense):
  """A Dense with a low-rank update written as plain matmuls in its scope."""

  @nn.compact
  def __call__(self, x):
    a = self.param("lora_a", nn.initializers.zeros, (x.shape[-1], 2))
    b = self.param("lora_b", nn.initializers.zeros, (2, self.features))
    return super().__call__(x) + (x @ a.astype(x.dtype)) @ b.astype(x.dtype)


class Mixed(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, dot_general_cls=QdqDot, name="qdq")(x)
    x = LoraDense(8, name="lora")(x)
    return nn.Dense(8, name="fine")(x)


def test_qdq_and_plain_matmuls_in_fp8_layers_are_named():
  _, v, loss = _setup(RECIPES["current"], net=Mixed(), exclude=())
  assert set(fp8.fp8_layers(v)) == {"qdq", "lora", "fine"}
  grad = jax.jit(jax.grad(loss, (0, 1)))
  with pytest.raises(ValueError) as info:
    fp8.check_fp8(grad, v["params"], v["fp8_meta"], X)
  lines = str(info.value).splitlines()[1:]
  assert {line.split(":")[0].strip() for line in lines} == {"qdq", "lora"}
  # The QDQ layer: no FP8 matmul in either pass, its dots in bfloat16.
  assert "  qdq: no FP8 matmul in the forward pass" in lines
  assert "  qdq: no FP8 matmul in the backward pass" in lines
  assert any(
    "qdq: dot_general bfloat16 x bfloat16 (forward) at " in line
    and line.endswith("/qdq/QdqDot_0")
    for line in lines
  )
  # The LoRA layer's own matmul is FP8; its two low-rank ones are not.
  assert not any("lora: no FP8" in line for line in lines)
  lora = [line for line in lines if line.startswith("  lora: dot_general")]
  assert lora and all(line.endswith("/lora") for line in lora)


def test_state_from_one_config_applied_by_another_is_caught():
  # init with every Dense in FP8, then train a model whose exclusion list
  # drifted: the state is there, the matmul is not FP8.
  _, v, _ = _setup(RECIPES["current"])
  _, _, drifted = _setup(RECIPES["current"], exclude=("head", "Block_0", "mix"))
  with pytest.raises(ValueError, match=r"mix: no FP8 matmul in the forward"):
    fp8.check_fp8(jax.grad(drifted, (0, 1)), v["params"], v["fp8_meta"], X)


def test_layers_by_path_and_pattern():
  _, v, loss = _setup(RECIPES["current"])
  args = (v["params"], v["fp8_meta"], X)
  grad = jax.grad(loss, (0, 1))
  assert set(fp8.check_fp8(grad, *args, layers="st*")) == {"stack"}
  assert set(fp8.check_fp8(grad, *args, layers=["Dense_0", "s*/*"])) == {
    "Dense_0",
    "stack/Dense_0",
  }
  with pytest.raises(ValueError) as info:
    fp8.check_fp8(grad, *args, layers=["Block_0", "nothing/*"])
  message = str(info.value)
  assert "Block_0: no FP8 matmul in the forward pass" in message
  assert "Block_0: dot_general bfloat16 x bfloat16 (backward)" in message
  assert "nothing/*: no matmul of fn carries this module path" in message


def test_compiled_program_on_cpu_runs_no_fp8_gemm():
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU has no FP8 GEMM; a GPU may have one")
  _, v, loss = _setup(RECIPES["current"])
  args = (v["params"], v["fp8_meta"], X)
  grad = jax.jit(jax.grad(loss, (0, 1)))
  compiled = grad.lower(*args).compile()
  hlo = fp8.compiled_matmuls(compiled)
  assert hlo and not any(m.fp8 for m in hlo)
  # The scanned, remat'd layer is found in the HLO by its module path.
  assert any(m.path.endswith("/stack/Dense_0/Fp8DotGeneral_0") for m in hlo)
  with pytest.raises(ValueError) as info:
    fp8.check_fp8(grad, *args, compiled=compiled)
  message = str(info.value)
  assert "the compiled program runs no FP8 GEMM" in message
  for layer in ASKED:
    assert f"{layer} (compiled): no FP8 matmul in the forward pass" in message
  # compiled=True compiles fn itself and names the backend.
  dense = jmp_train.linen.wrap(nn.Dense(4), "float32", fp8="current")
  dv = jax.eval_shape(dense.init, jax.random.key(0), X)

  def dense_loss(params, meta, x):
    return dense.apply({"params": params, "fp8_meta": meta}, x).sum()

  dense_args = (dv["params"], dv["fp8_meta"], X)
  with pytest.raises(ValueError, match="backend 'cpu'.* runs no FP8 GEMM"):
    fp8.check_fp8(jax.grad(dense_loss, (0, 1)), *dense_args, compiled=True)
  # The jaxpr alone passes.
  assert set(fp8.check_fp8(grad, *args)) == ASKED


@flax.struct.dataclass
class State:
  params: dict
  fp8: dict


def test_fp8_layers_reads_paths_from_any_container():
  leaf = {"Fp8DotGeneral_0": {"fp8": fp8.init_state(fp8.CurrentScaling())}}
  meta = {"enc": {"Dense_0": leaf}, "head": leaf}
  want = ["enc/Dense_0", "head"]
  assert fp8.fp8_layers(meta) == want
  assert fp8.fp8_layers({"params": {}, "fp8_meta": meta}) == want
  assert fp8.fp8_layers(State(params={}, fp8=meta)) == want
  assert fp8.fp8_layers(x=1, state=State(params={}, fp8=meta)) == want


def test_bad_arguments_are_refused():
  _, v, loss = _setup(RECIPES["current"])
  with pytest.raises(TypeError, match="layers takes module paths.*got 3"):
    fp8.check_fp8(loss, v["params"], v["fp8_meta"], X, layers=3)
  with pytest.raises(TypeError, match="backward takes True, False or None"):
    fp8.check_fp8(loss, v["params"], v["fp8_meta"], X, backward="yes")
  with pytest.raises(ValueError, match="args hold no Fp8DotState"):
    fp8.check_fp8(lambda p: loss(p, v["fp8_meta"], X), v["params"])
  with pytest.raises(TypeError, match="fn must be callable"):
    fp8.check_fp8("loss")
  # NNX state: the message names the cause (no paths), not a missing state.
  model = jmp_train.nnx.wrap(
    nnx.Linear(8, 3, rngs=nnx.Rngs(0)), "float32", fp8="current"
  )
  graphdef, state = nnx.split(model)
  apply = lambda s: jnp.sum(nnx.merge(graphdef, s)(X))  # noqa: E731
  with pytest.raises(ValueError, match="NNX records no module paths"):
    fp8.check_fp8(jax.grad(apply), state)
  with pytest.raises(TypeError, match="jax.stages.Compiled or its HLO text"):
    fp8.compiled_matmuls(3)


# XLA's GPU forms, as its optimized HLO prints them (the shapes of
# xla/service/gpu/transforms/gemm_rewriter_fp8_test.cc): a cuBLASLt FP8
# call returning (result, workspace), and a Triton GEMM fusion whose dot
# takes FP8 parameters. Hand-written: no GPU here to compile them.
_STACK = "jit(loss)/{}(_Wrapped)/_Wrapped._run/_Wrapped.body/module/{}"
_FUSED = """
%gemm_fusion (p0: f8e4m3fn[2,8], p1: f8e4m3fn[8,4]) -> bf16[2,4] {
  %p0 = f8e4m3fn[2,8]{1,0} parameter(0)
  %p1 = f8e4m3fn[8,4]{1,0} parameter(1)
  ROOT %dot.3 = bf16[2,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}{meta}
}
"""
_ENTRY = """
ENTRY %main (x: f8e4m3fn[2,8], w: f8e4m3fn[8,4], g: f8e5m2[2,4], s: f32[]) -> bf16[2,4] {
  %x = f8e4m3fn[2,8]{1,0} parameter(0)
  %w = f8e4m3fn[8,4]{1,0} parameter(1)
  %g = f8e5m2[2,4]{1,0} parameter(2)
  %s = f32[] parameter(3)
  %xb = bf16[2,8]{1,0} convert(%x)
  %wb = bf16[8,4]{1,0} convert(%w)
"""


def _gemm(name, target, lhs, rhs, meta):
  return (
    f"  %{name} = (bf16[16,16]{{1,0}}, s8[33554432]{{0}}) custom-call(%{lhs}, "
    f'%{rhs}, %s, %s), custom_call_target="{target}", '
    f'backend_config={{"gemm_backend_config":{{"alpha_real":1}}}}{meta}\n'
  )


def _meta(transform, layer):
  path = _STACK.format(transform, f"{layer}/Fp8DotGeneral_0/dot_general")
  return f', metadata={{op_name="{path}"}}'


class Two(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="b")(nn.Dense(8, name="a")(x))


def _gpu_hlo(b_forward, b_forward_meta=True):
  """Layer a in cuBLASLt FP8 both passes; b's backward in FP8 and its
  forward as `b_forward` says: "triton" (an FP8 GEMM fusion) or "bf16"."""
  meta_b = _meta("jvp", "b") if b_forward_meta else ""
  fused = _FUSED.replace("{meta}", meta_b) if b_forward == "triton" else ""
  text = "HloModule jit_loss\n" + fused + _ENTRY
  text += _gemm("a_fwd", fp8.CUBLAS_FP8_TARGET, "x", "w", _meta("jvp", "a"))
  a_bwd = _meta("transpose(jvp", "a").replace("(_Wrapped)", "(_Wrapped))")
  b_bwd = _meta("transpose(jvp", "b").replace("(_Wrapped)", "(_Wrapped))")
  text += _gemm("a_bwd", fp8.CUBLAS_FP8_TARGET, "g", "w", a_bwd)
  text += _gemm("b_bwd", fp8.CUBLAS_FP8_TARGET, "g", "w", b_bwd)
  if b_forward == "triton":
    text += (
      "  ROOT %b_fwd = bf16[2,4]{1,0} fusion(%x, %w), kind=kCustom, "
      'calls=%gemm_fusion, backend_config={"fusion_backend_config":'
      '{"kind":"__triton_gemm"}}\n'
    )
  else:
    text += _gemm("b_fwd", "__cublas$lt$matmul", "xb", "wb", meta_b)
  return text + "}\n"


def test_compiled_check_reads_xla_gpu_fp8_gemms():
  _, v, loss = _setup(RECIPES["current"], net=Two(), exclude=())
  args = (v["params"], v["fp8_meta"], X)
  grad = jax.grad(loss, (0, 1))
  found = fp8.compiled_matmuls(_gpu_hlo("triton"))
  assert [(m.primitive, m.dtypes, m.backward, m.fp8) for m in found] == [
    ("dot", ("float8_e4m3fn", "float8_e4m3fn"), False, True),
    (fp8.CUBLAS_FP8_TARGET, ("float8_e4m3fn", "float8_e4m3fn"), False, True),
    (fp8.CUBLAS_FP8_TARGET, ("float8_e5m2", "float8_e4m3fn"), True, True),
    (fp8.CUBLAS_FP8_TARGET, ("float8_e5m2", "float8_e4m3fn"), True, True),
  ]
  assert found[0].path == "_Wrapped/module/b/Fp8DotGeneral_0"
  summary = fp8.check_fp8(grad, *args, compiled=_gpu_hlo("triton"))
  assert summary["b"] == {
    "forward": 1,
    "backward": 2,
    "compiled_forward": 1,
    "compiled_backward": 1,
  }
  # b's forward GEMM upcast to bfloat16: caught, with what it became.
  with pytest.raises(ValueError) as info:
    fp8.check_fp8(grad, *args, compiled=_gpu_hlo("bf16"))
  lines = str(info.value).splitlines()[1:]
  assert lines == [
    "  b (compiled): no FP8 matmul in the forward pass",
    "  b (compiled): __cublas$lt$matmul bfloat16 x bfloat16 (forward) at "
    "_Wrapped/module/b/Fp8DotGeneral_0",
  ]
  # Without an op_name a GEMM belongs to no layer: an FP8 one may be b's,
  # a bfloat16 one may be b's upcast.
  assert fp8.check_fp8(grad, *args, compiled=_gpu_hlo("triton", False))
  with pytest.raises(
    ValueError,
    match=r"b \(compiled\): no FP8 matmul in the forward pass \(XLA dropped "
    r"the op_name of 1 matmul\(s\), 1 of them not FP8",
  ):
    fp8.check_fp8(grad, *args, compiled=_gpu_hlo("bf16", False))


def test_modules_named_like_jax_scope_labels_keep_their_paths():
  """Compiled op names carry JAX's own scope labels (while/body, cond,
  checkpoint); a jaxpr's name stacks carry none, so there a layer named
  "body" or "checkpoint" is a layer like any other."""

  class Step(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.Dense(8, name="cond")(x), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(8, name="body")(x)
      x = nn.remat(nn.Dense)(8, name="while")(x)
      layers = nn.scan(
        nn.remat(Step),
        variable_axes={"params": 0, "fp8_meta": 0},
        split_rngs={"params": True},
        length=2,
      )
      x, _ = layers(name="checkpoint")(x, None)
      return nn.Dense(2, name="head")(x)

  model = jmp_train.linen.wrap(Model(), "float32", fp8="current")
  x = jnp.ones((2, 8))
  v = jax.jit(model.init)(jax.random.key(0), x)

  def loss(params, meta):
    return jnp.sum(model.apply({"params": params, "fp8_meta": meta}, x))

  grad = jax.grad(loss, (0, 1))
  both = {"forward": 1, "backward": 2}
  names = ("body", "while", "checkpoint/cond", "head")
  assert fp8.check_fp8(grad, v["params"], v["fp8_meta"]) == dict.fromkeys(
    names, both
  )
  found = fp8.matmuls(grad, v["params"], v["fp8_meta"])
  forward = {m.path for m in found if not m.backward}
  want = {f"_Wrapped/module/{n}/Fp8DotGeneral_0" for n in names}
  assert forward == want

  # jax.checkpoint's own label, added while tracing, is no module.
  def remat_loss(x, w):
    def f(x, w):
      with jax.named_scope("layer"):
        return jnp.sin(x @ w) @ w

    return jnp.sum(jax.checkpoint(f)(x, w))

  grads = jax.grad(remat_loss, (0, 1))
  ones = jnp.ones((2, 4)), jnp.ones((4, 4))
  assert {m.path for m in fp8.matmuls(grads, *ones)} == {"layer"}

"""Proof that FP8 ran: find the FP8 matmuls in a program, per layer.

An FP8 recipe can fail without a word: a layer given its own `dot_general`,
a quantize-dequantize pattern XLA did not fuse (Flax PR 4686, MaxText PR
1893), or a GPU that upcasts the operands all train, only not in FP8. This
module reads what the program does instead of trusting the configuration:

    matmuls(fn, *args)          every dot_general / conv in fn's jaxpr, all
                                sub-jaxprs included (jit, custom_vjp, scan,
                                while, cond, remat, shard_map), with the
                                module path from its name stack, its
                                operand dtypes and its pass
    compiled_matmuls(compiled)  the same for XLA's optimized HLO: dots,
                                convolutions and GEMM custom calls
                                ("__cublas$lt$matmul$f8" is cuBLASLt in FP8)
    check_fp8(fn, *args)        raises unless every layer asked for runs its
                                matmuls in FP8, in both passes when fn
                                differentiates

A matmul runs in FP8 when both operands are float8. Its module path is the
name stack JAX records for it: Flax labels ops with the path of the module
that runs them (while `flax_profile` is on, the default). The path is read
with JAX's transformations (`jvp(...)`, `transpose(...)`), JAX's own labels
("rematted_computation"; the lowering's "jit(f)", "while", "body", "cond",
"closed_call", "checkpoint") and Flax's method scopes ("Block.encode") taken
out. A matmul is in the backward pass when `transpose` is among its
transformations (a remat'd layer's recomputed forward matmuls count there).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
from jax.extend import core as jex_core

from jmp_train._src.fp8 import COLLECTION, is_fp8_state, states

# The jaxpr primitives that multiply matrices.
MATMUL_PRIMITIVES = (
  "dot_general",
  "conv_general_dilated",
  "ragged_dot_general",
)
# The cuBLASLt custom call XLA's GPU compiler emits for an FP8 GEMM
# (xla/service/gpu/cublas_cudnn.cc, kCublasLtMatmulF8CallTarget).
CUBLAS_FP8_TARGET = "__cublas$lt$matmul$f8"
_HLO_MATMULS = ("dot", "convolution", "ragged-dot")
_GEMM_TARGET = re.compile(r"^__(cublas\$(gemm|lt\$matmul)|cudnn\$conv)")
# Scope names added while tracing, dropped from every path: jax.checkpoint's
# (JAX 0.10: ad_checkpoint.py) and ours (an override's named call).
_TRACE_LABELS = re.compile(
  r"^(rematted_computation|jmp_train_policy_override)$"
)
# Scope names JAX adds by itself to compiled op names: those, and the
# lowering's for control flow and calls (lax/control_flow,
# interpreters/mlir.py, shard_map.py). A jaxpr's name stacks hold none of
# the lowering's, so there a module may be called "body" or "cond".
_JAX_LABELS = re.compile(
  r"^(rematted_computation|checkpoint|while|body|body_pred|cond|"
  r"branch_\d+_fun|closed_call|core_call|shmap_body|"
  r"jmp_train_policy_override)$"
)
_WRAPPED = re.compile(r"^([A-Za-z_]\w*)\((.*)\)$")
_METHOD = re.compile(r"^([A-Za-z_]\w*)\.[A-Za-z_]\w*$")
_PASSES = ("forward", "backward")
_SHOWN = 40  # problems listed in check_fp8's error


class Matmul(NamedTuple):
  """One matmul of a program.

  Attributes:
    path: the module path from its name stack, "/"-joined (the root module
      first, e.g. "Model/block/Dense_0/Fp8DotGeneral_0"); None for a
      compiled matmul whose op_name XLA dropped.
    primitive: "dot_general" or "conv_general_dilated" in a jaxpr; "dot",
      "convolution" or the custom call target in compiled HLO.
    dtypes: the dtype names of its two operands.
    backward: whether it runs in the backward pass.
    fp8: whether it runs in FP8 (both operands float8, or an FP8 GEMM call).
  """

  path: str | None
  primitive: str
  dtypes: tuple[str, str]
  backward: bool
  fp8: bool

  def describe(self) -> str:
    """E.g. "dot_general bfloat16 x bfloat16 (forward) at Model/head"."""
    where = "<no op_name>" if self.path is None else self.path or "<root>"
    dtypes = " x ".join(self.dtypes)
    return f"{self.primitive} {dtypes} ({_PASSES[self.backward]}) at {where}"


def _is_fp8_dtype(name: str) -> bool:
  return name.startswith("float8_")


def _scopes(
  name_stack: str, labels: re.Pattern = _TRACE_LABELS
) -> tuple[tuple[str, ...], bool]:
  """Module names of a rendered name stack (less the scope names `labels`
  matches), and whether it is transposed."""
  names: list[str] = []
  transposed = False
  for part in name_stack.split("/"):
    wrappers = []
    while m := _WRAPPED.match(part):
      wrappers.append(m.group(1))
      part = m.group(2)
    transposed |= "transpose" in wrappers
    if not part or "jit" in wrappers or labels.match(part):
      continue
    method = _METHOD.match(part)
    if method and names and names[-1] == method.group(1):
      continue  # a Flax method scope of the module just entered
    names.append(method.group(1) if method else part)
  return tuple(names), transposed


def matmuls(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Matmul]:
  """Every matmul in the jaxpr of `fn(*args, **kwargs)`, in program order.

  Pass the function the training runs, differentiated: `jax.grad(loss)` or
  the train step, so that the backward pass is in the program too.

  Example:
    >>> import jax.numpy as jnp
    >>> from jmp_train.fp8 import CurrentScaling, fp8_dot_general
    >>> def loss(x, w):
    ...   with jax.named_scope("layer"):
    ...     y = fp8_dot_general(x, w, (((1,), (0,)), ((), ())),
    ...                         scale=jnp.ones(3), amax=jnp.zeros(3),
    ...                         recipe=CurrentScaling())
    ...   return jnp.sum(y @ w.T)
    >>> for m in matmuls(jax.grad(loss, (0, 1)), jnp.ones((2, 4)), jnp.ones((4, 4))):
    ...   print(m.describe())
    dot_general float8_e4m3fn x float8_e4m3fn (forward) at layer
    dot_general float32 x float32 (forward) at <root>
    dot_general float32 x float32 (backward) at <root>
    dot_general float32 x float32 (backward) at <root>
    dot_general float8_e5m2 x float8_e4m3fn (backward) at layer
    dot_general float8_e5m2 x float8_e4m3fn (backward) at layer
  """
  if not callable(fn):
    raise TypeError(f"matmuls: fn must be callable, got {fn!r}.")
  jaxpr = jax.make_jaxpr(fn)(*args, **kwargs).jaxpr
  found: list[Matmul] = []

  def walk(jaxpr: jex_core.Jaxpr, outer: Any) -> None:
    for eqn in jaxpr.eqns:
      # A sub-jaxpr's name stacks continue its equation's, as in lowering.
      stack = eqn.source_info.name_stack
      stack = stack if outer is None else outer + stack
      if eqn.primitive.name in MATMUL_PRIMITIVES:
        names, backward = _scopes(str(stack))
        dtypes = tuple(v.aval.dtype.name for v in eqn.invars[:2])
        found.append(
          Matmul(
            "/".join(names),
            eqn.primitive.name,
            dtypes,
            backward,
            all(_is_fp8_dtype(d) for d in dtypes),
          )
        )
      for sub in jex_core.jaxprs_in_params(eqn.params):
        walk(sub, stack)

  walk(jaxpr, None)
  return found


# ---------------------------------------------------------------------------
# Compiled HLO.

_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<type>.+?)\s+"
  r"(?P<op>[a-z][\w\-]*)\((?P<tail>.*)$"
)
_HLO_TYPE = re.compile(r"^(?P<kind>pred|bf16|[fsu]\d+)(?P<rest>\w*)\[")


def _dtype_name(hlo_type: str) -> str:
  """numpy's name for an HLO element type: f8e4m3fn -> float8_e4m3fn."""
  m = _HLO_TYPE.match(hlo_type.strip())
  if not m:
    return "?"
  kind, rest = m.group("kind"), m.group("rest")
  if kind in ("pred", "bf16"):
    return {"pred": "bool", "bf16": "bfloat16"}[kind]
  base = {"f": "float", "s": "int", "u": "uint"}[kind[0]] + kind[1:]
  return f"{base}_{rest}" if rest else base


def _operands(tail: str) -> list[str]:
  """The comma-separated operands up to the call's closing parenthesis."""
  depth, current, out = 0, [], []
  for ch in tail:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      if depth == 0:
        break
      depth -= 1
    if ch == "," and depth == 0:
      out.append("".join(current).strip())
      current = []
    else:
      current.append(ch)
  out.append("".join(current).strip())
  return [o for o in out if o]


def compiled_matmuls(compiled: Any) -> list[Matmul]:
  """Every matmul in a compiled program: XLA's optimized HLO, as it runs.

  Reads dots, convolutions and GEMM custom calls from every computation
  (fusions included), with the module path from each one's `op_name`
  metadata. A matmul is FP8 when it is the cuBLASLt FP8 call
  ("__cublas$lt$matmul$f8") or a dot whose operands are both float8 (a
  Triton or cuDNN GEMM fusion on GPU). XLA:CPU converts FP8 operands to a
  wider type before a dot, so on CPU none is FP8.

  Args:
    compiled: a `jax.stages.Compiled` (`jax.jit(f).lower(*args).compile()`)
      or its `as_text()`.

  Returns:
    The matmuls, in the order of the HLO text.

  Example:
    >>> import jax.numpy as jnp
    >>> f = jax.jit(lambda a, b: a @ b)
    >>> x = jnp.ones((2, 2), jnp.float8_e4m3fn)
    >>> [m.fp8 for m in compiled_matmuls(f.lower(x, x).compile())]
    [False]
  """
  text = compiled if isinstance(compiled, str) else None
  if text is None:
    if not callable(getattr(compiled, "as_text", None)):
      raise TypeError(
        "compiled_matmuls: compiled must be a jax.stages.Compiled or its "
        f"HLO text (str), got {type(compiled).__name__}."
      )
    text = compiled.as_text()
  types: dict[str, str] = {}
  parsed = []
  for line in text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    types[m.group("name")] = m.group("type")
    parsed.append(m)
  found = []
  for m in parsed:
    op, tail = m.group("op"), m.group("tail")
    target = re.search(r'custom_call_target="([^"]*)"', tail)
    target = target.group(1) if target else ""
    if op not in _HLO_MATMULS and not (
      op == "custom-call" and _GEMM_TARGET.match(target)
    ):
      continue
    dtypes = []
    for operand in _operands(tail)[:2]:
      *typed, name = operand.split()
      hlo_type = typed[0] if typed else types.get(name.lstrip("%"), "")
      dtypes.append(_dtype_name(hlo_type))
    op_name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', tail)
    path, backward = None, False
    if op_name:  # the name stack, then the primitive: ".../dot_general"
      names, backward = _scopes(
        op_name.group(1).rpartition("/")[0], _JAX_LABELS
      )
      path = "/".join(names)
    fp8 = target == CUBLAS_FP8_TARGET or all(map(_is_fp8_dtype, dtypes))
    found.append(Matmul(path, target or op, tuple(dtypes), backward, fp8))
  return found


# ---------------------------------------------------------------------------
# The check.


def _fp8_modules(args: Any, kwargs: Any) -> list[str]:
  """The module paths of the FP8 matmul modules holding state in args."""
  found = []
  leaves = jax.tree_util.tree_flatten_with_path(
    (args, kwargs), is_leaf=is_fp8_state
  )[0]
  for path, leaf in leaves:
    if not is_fp8_state(leaf):
      continue
    names: list[str] = []
    for key in path[2:]:  # past (args, kwargs) and the argument
      is_dict = isinstance(key, jax.tree_util.DictKey)
      if is_dict and str(key.key) != COLLECTION:
        names.append(str(key.key))
      else:  # the collection, an attribute, an index: paths start after
        names = []
    module = "/".join(names[:-1])  # the variable's own name ("fp8") off
    if module and module not in found:
      found.append(module)
  return found


def fp8_layers(*args: Any, **kwargs: Any) -> list[str]:
  """The module paths of the layers holding FP8 state in `args`.

  Each `Fp8DotState` sits at `<layer>/<Fp8DotGeneral module>/fp8` in the
  "fp8_meta" collection. The path is read from the dict keys of the state's
  place in `args`: those after the "fp8_meta" key, or after the last
  attribute or sequence index (so a variables dict, the bare collection and
  `TrainState.fp8` all give the same path).

  Example:
    >>> from jmp_train.fp8 import CurrentScaling, init_state
    >>> state = {"Fp8DotGeneral_0": {"fp8": init_state(CurrentScaling())}}
    >>> meta = {"mlp": {"Dense_0": state}, "head": state}
    >>> fp8_layers({"params": {}, "fp8_meta": meta})
    ['head', 'mlp/Dense_0']
  """
  layers = []
  for module in _fp8_modules(args, kwargs):
    layer = module.rpartition("/")[0] or module
    if layer not in layers:
      layers.append(layer)
  return layers


def _roots(records: Iterable[Matmul], modules: Iterable[str]) -> set[tuple]:
  """The name-stack prefixes in front of the FP8 modules' paths.

  A name stack begins with scopes that are not in the variables' paths (the
  root module's class name, a wrapper's field); each FP8 matmul inside a
  known FP8 module shows them. Anchoring layer paths after them keeps
  "Dense_0" from matching "Block_0/Dense_0".
  """
  modules = {tuple(m.split("/")) for m in modules}
  roots = set()
  for path in {m.path for m in records if m.fp8 and m.path}:
    names = tuple(path.split("/"))
    # The longest known module in the path: "Block_0/Dense_0/Fp8DotGeneral_0"
    # over "Dense_0/Fp8DotGeneral_0" when both hold state.
    spans = [
      (j - i, i)
      for i in range(len(names))
      for j in range(i + 1, len(names) + 1)
      if names[i:j] in modules
    ]
    if spans:
      roots.add(names[: max(spans)[1]])
  return roots


def _layer_of(m: Matmul, roots: set[tuple], asked: Callable) -> str | None:
  """The outermost layer asked for that holds `m`, by its module path."""
  if m.path is None:
    return None
  names = tuple(m.path.split("/")) if m.path else ()
  if roots:
    starts = sorted({len(r) for r in roots if names[: len(r)] == r})
  else:  # nothing to anchor on: a layer path may start anywhere
    starts = range(len(names))
  for start in starts:
    for end in range(start + 1, len(names) + 1):
      path = "/".join(names[start:end])
      if asked(path):
        return path
  return None


def _check_layers(layers: Any) -> tuple[str, ...] | None:
  if layers is None:
    return None
  items = (layers,) if isinstance(layers, str) else layers
  try:
    items = tuple(items)
  except TypeError:
    items = (layers,)
  if not items or not all(isinstance(x, str) and x for x in items):
    raise TypeError(
      "check_fp8: layers takes module paths or glob patterns (non-empty "
      f"str, e.g. 'block/Dense_0' or '*/mlp/*'), got {layers!r}."
    )
  return items


def _group(records, roots, asked) -> dict[str, list[Matmul]]:
  by_layer: dict[str, list[Matmul]] = {}
  layer_of: dict[str | None, str | None] = {}  # many matmuls share a path
  for m in records:
    if m.path not in layer_of:
      layer_of[m.path] = _layer_of(m, roots, asked)
    layer = layer_of[m.path]
    if layer is not None:
      by_layer.setdefault(layer, []).append(m)
  return by_layer


def _faults(layer, found, passes, unknown=()) -> list[str]:
  """What keeps one layer's matmuls from being all FP8.

  `unknown` holds compiled matmuls without a path (XLA dropped their
  op_name): a pass with no FP8 matmul of the layer's own is a fault unless
  every one of them is FP8, as the layer's could be among them.
  """
  out = []
  for name in passes:
    if any(m.fp8 and _PASSES[m.backward] == name for m in found):
      continue
    if unknown and all(m.fp8 for m in unknown):
      continue
    why = ""
    if unknown:
      wide = sum(not m.fp8 for m in unknown)
      why = (
        f" (XLA dropped the op_name of {len(unknown)} matmul(s), {wide} of "
        "them not FP8, which may be this layer's)"
      )
    out.append(f"{layer}: no FP8 matmul in the {name} pass{why}")
  wide = dict.fromkeys(m.describe() for m in found if not m.fp8)
  return out + [f"{layer}: {d}" for d in wide]


def _counts(found, prefix=""):
  return {
    f"{prefix}{name}": sum(m.fp8 and m.backward == b for m in found)
    for b, name in enumerate(_PASSES)
  }


def check_fp8(
  fn: Callable[..., Any],
  *args: Any,
  layers: str | Iterable[str] | None = None,
  backward: bool | None = None,
  compiled: Any = False,
  **kwargs: Any,
) -> dict[str, dict[str, int]]:
  """Raises unless every layer asked for runs its matmuls in FP8.

  Traces `fn(*args, **kwargs)` (a loss under `jax.grad`, or the train
  step) and requires of each layer asked for:

      an FP8 matmul in the forward pass,
      an FP8 matmul in the backward pass      (when `backward`),
      no matmul in it with an operand that is not float8.

  The layers asked for are those holding FP8 state in `args` (the
  `Fp8DotState`s of the "fp8_meta" collection, see `fp8_layers`), or the
  module paths and glob patterns given as `layers`, matched against each
  matmul's module path from the root down (a pattern takes the outermost
  module it matches). With `compiled`, the same is required of the program
  XLA compiled (`compiled_matmuls`): an FP8 matmul of the jaxpr that the
  backend upcast fails there, as every one does on CPU, which has no FP8
  GEMM.

  Args:
    fn: the function to check, e.g. `jax.grad(loss)` or a train step.
    *args, **kwargs: its arguments (arrays or `jax.ShapeDtypeStruct`s).
    layers: module paths or glob patterns of the layers that must run in
      FP8; None: the layers holding FP8 state in `args`.
    backward: require FP8 in the backward pass; None requires it when the
      program has one.
    compiled: also check the compiled program: True compiles `jax.jit(fn)`
      for `args`, or pass a `jax.stages.Compiled` or its HLO text.

  Returns:
    Per layer, its FP8 matmuls: {"forward": n, "backward": n}, and the
    compiled program's as "compiled_forward", "compiled_backward".

  Raises:
    ValueError: naming each layer that does not run in FP8, and why.

  Example:
    >>> import flax.linen as nn, jax.numpy as jnp, jmp_train
    >>> mlp = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    >>> model = jmp_train.linen.wrap(mlp, "float32", fp8="current")
    >>> x = jnp.ones((4, 8))
    >>> v = jax.eval_shape(model.init, jax.random.key(0), x)  # shapes will do
    >>> def loss(params, meta):
    ...   return model.apply({"params": params, "fp8_meta": meta}, x).sum()
    >>> check_fp8(jax.grad(loss, (0, 1)), v["params"], v["fp8_meta"])
    {'layers_0': {'forward': 1, 'backward': 2}, 'layers_2': {'forward': 1, 'backward': 2}}
  """
  if not callable(fn):
    raise TypeError(f"check_fp8: fn must be callable, got {fn!r}.")
  patterns = _check_layers(layers)
  if backward not in (None, True, False):
    raise TypeError(
      f"check_fp8: backward takes True, False or None, got {backward!r}."
    )
  modules = _fp8_modules(args, kwargs)
  if patterns is None:
    wanted = fp8_layers(*args, **kwargs)
    if not wanted and states((args, kwargs)):
      raise ValueError(
        "check_fp8: args hold FP8 state, but not in a linen 'fp8_meta' "
        "collection (NNX layers keep it in jmp_train.nnx.Fp8Meta variables), "
        "and NNX records no module paths in the jaxpr, so check_fp8 cannot "
        "tell its layers apart: list each matmul's operand dtypes with "
        "fp8.matmuls(fn, *args) instead."
      )
    if not wanted:
      raise ValueError(
        "check_fp8: with layers=None it checks the layers holding FP8 "
        "state, but args hold no Fp8DotState (the 'fp8_meta' collection); "
        "pass it, or name the layers: layers=['block/Dense_0', '*/mlp/*']."
      )
    asked = set(wanted).__contains__
  else:
    wanted = list(patterns)
    asked = lambda path: any(fnmatch.fnmatchcase(path, p) for p in patterns)  # noqa: E731
  records = matmuls(fn, *args, **kwargs)
  roots = _roots(records, modules)
  if backward is None:
    backward = any(m.backward for m in records)
  passes = _PASSES if backward else _PASSES[:1]
  by_layer = _group(records, roots, asked)
  problems = []
  for want in wanted:
    if not any(
      layer == want or (patterns and fnmatch.fnmatchcase(layer, want))
      for layer in by_layer
    ):
      problems.append(
        f"{want}: no matmul of fn carries this module path (is the layer "
        "called by fn? Flax names ops after modules while flax_profile is "
        "on, its default)"
      )
  summary = {}
  for layer, found in by_layer.items():
    problems += _faults(layer, found, passes)
    summary[layer] = _counts(found)
  if compiled is not False:
    backend = "the compiled program"
    if compiled is True:
      compiled = jax.jit(fn).lower(*args, **kwargs).compile()
      backend += f" (backend {jax.default_backend()!r})"
    problems += _compiled_faults(
      compiled_matmuls(compiled), roots, asked, passes, summary, backend
    )
  if problems:
    shown = problems[:_SHOWN] + [f"... and {len(problems) - _SHOWN} more"]
    raise ValueError(
      "check_fp8: FP8 did not run where it was asked for (a layer runs in "
      "FP8 when each matmul in it has two float8 operands):\n  "
      + "\n  ".join(shown if len(problems) > _SHOWN else problems)
    )
  return summary


def _compiled_faults(hlo, roots, asked, passes, summary, backend):
  """`_faults` of each layer in `summary`, in the compiled program."""
  out = []
  if not any(m.fp8 for m in hlo):
    out.append(
      f"{backend} runs no FP8 GEMM: XLA converted the FP8 operands of "
      "every matmul to a wider type (XLA runs FP8 GEMMs on NVIDIA GPUs of "
      "compute capability 8.9 or newer: Ada, Hopper, Blackwell)"
    )
  by_layer = _group(hlo, roots, asked)
  unknown = [m for m in hlo if m.path is None]
  for layer, counts in summary.items():
    found = by_layer.get(layer, [])
    out += _faults(f"{layer} (compiled)", found, passes, unknown)
    counts.update(_counts(found, "compiled_"))
  return out

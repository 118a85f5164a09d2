"""Per-operation autocast: torch.autocast and Apex O1 for any JAX function.

`autocast(fn, policy)` traces `fn` to a jaxpr and evaluates it again, one
primitive at a time, with each primitive's float operands cast by the list
that names it (`AutocastLists`):

* `compute` (matmuls and convolutions): operands in the policy's compute
  dtype, the product in the compute dtype (the backends accumulate a
  bfloat16 or float16 product in float32);
* `float32` (exp, log, pow, rsqrt, sums, maxima, ...): operands in float32;
* `passthrough` (collectives, barriers): each operand as it comes;
* `as_written` (bit casts, callbacks): operands in the dtypes `fn` was traced
  with, so the primitive runs exactly as written;
* everything else: operands in their promoted dtype, the widest of them
  (a Python scalar's weak type does not widen), as torch.autocast runs ops
  on no list.

Integer, boolean, complex and FP8 values are never cast. A primitive with an
FP8 operand, and a `custom_jvp`/`custom_vjp` function that computes with FP8
values (jmp_train's FP8 matmuls), runs as written. So does a matmul with an
explicit precision, and everything traced inside a region with a policy of
its own: a `linen.wrap`/`nnx.wrap` module with a policy override, or an inner
`autocast` (both open the name scope `OVERRIDE_SCOPE`). The innermost policy
wins.

Higher-order primitives are evaluated structurally, with their bodies
autocast: `jit` (inlined, its explicit shardings kept as constraints),
`checkpoint` (`jax.checkpoint` with the same policy), `scan`, `while` and
`cond` (loop carries keep the dtype they were traced with; `cond` branches
agree on the promoted dtype of each output), `shard_map`, and `custom_jvp` /
`custom_vjp` functions, whose custom rules are kept: the JVP rule is
evaluated with the same lists, and the VJP's `bwd` gets residuals and
cotangents in the dtypes it was traced with, its jaxpr autocast too. Any
other primitive that carries a jaxpr runs as written.

Why a jaxpr interpreter rather than a tracer that casts on the fly: the
jaxpr is the program as JAX sees it, whichever library built it (Flax,
Equinox, Haiku, plain jax.numpy), and it names every primitive, so the lists
are the whole contract.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import ad_util, source_info_util
from jax.extend import core as jex_core

from jmp_train._src import policy as policy_lib
from jmp_train._src.autocast_lists import STRUCTURAL, AutocastLists

# linen.wrap runs a module that has a policy override in this name scope:
# what is traced inside it runs as written.
OVERRIDE_SCOPE = policy_lib.OVERRIDE_SCOPE

# --- the dtype rules ------------------------------------------------------


def _float_size(dtype: Any) -> int:
  """The byte size of a real floating dtype; 0 for any other (integers,
  booleans, complex, PRNG keys)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return 0
  if not jnp.issubdtype(dtype, jnp.floating):
    return 0
  return np.dtype(dtype).itemsize


def _castable(dtype: Any) -> bool:
  """A float16/bfloat16/float32/float64 dtype: what autocast may cast."""
  return _float_size(dtype) > 1


def _is_fp8_dtype(dtype: Any) -> bool:
  return _float_size(dtype) == 1


def _dtype(x: Any) -> Any:
  return jax.typeof(x).dtype


def _cast(x: Any, dtype: Any) -> Any:
  """`x` in `dtype` if it is a castable float of another dtype."""
  if _castable(_dtype(x)) and _dtype(x) != np.dtype(dtype):
    return lax.convert_element_type(x, dtype)
  return x


def _as_written(values: list, avals: list) -> list:
  """`values` cast back to the dtypes `avals` were traced with."""
  return [
    _cast(v, a.dtype) if _castable(a.dtype) else v
    for v, a in zip(values, avals, strict=True)
  ]


def _promoted(values: list, atoms: list) -> np.dtype | None:
  """The widest dtype of the float operands.

  Constants of the program (jaxpr literals: `0.0` in `max(x, 0.0)`, an
  epsilon) and weak-typed values count only when every float operand is one,
  as a Python scalar does in JAX's promotion; except a constant that the
  dtype would turn from finite into inf (`-1e30` in float16), which widens
  it instead.
  """
  floats = [
    (v, a) for v, a in zip(values, atoms, strict=True) if _castable(_dtype(v))
  ]
  if not floats:
    return None

  def weak(atom):
    return isinstance(atom, jex_core.Literal) or atom.aval.weak_type

  strong = [_dtype(v) for v, a in floats if not weak(a)]
  dtype = functools.reduce(
    jnp.promote_types, strong or [_dtype(v) for v, _ in floats]
  )
  for _, a in floats:
    if isinstance(a, jex_core.Literal) and _overflows(a.val, dtype):
      dtype = jnp.promote_types(dtype, np.asarray(a.val).dtype)
  return np.dtype(dtype)


def _cast_outputs(values: list, dtypes: list) -> list:
  return [
    _cast(v, d) if d is not None else v
    for v, d in zip(values, dtypes, strict=True)
  ]


@dataclasses.dataclass(frozen=True)
class _Config:
  compute_dtype: np.dtype
  lists: AutocastLists


def _contains_fp8(jaxpr: Any) -> bool:
  """Whether any value in `jaxpr` (or a jaxpr inside it) is FP8."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  variables = [*jaxpr.constvars, *jaxpr.invars]
  for eqn in jaxpr.eqns:
    variables += [*eqn.invars, *eqn.outvars]
    for sub in jex_core.jaxprs_in_params(eqn.params):
      if _contains_fp8(sub):
        return True
  return any(
    hasattr(v.aval, "dtype") and _is_fp8_dtype(v.aval.dtype) for v in variables
  )


# --- the interpreter ------------------------------------------------------


def _eval(jaxpr: Any, consts: list, args: list, config: _Config) -> list:
  """`jaxpr` evaluated on `args` (any float dtypes) with autocast."""
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    name_stack = (
      source_info_util.current_name_stack() + eqn.source_info.name_stack
    )
    with (
      source_info_util.user_context(
        eqn.source_info.traceback, name_stack=name_stack
      ),
      eqn.ctx.manager,
    ):
      outs = _eval_eqn(eqn, invals, config)
    if not eqn.primitive.multiple_results:
      outs = [outs]
    for v, x in zip(eqn.outvars, outs, strict=True):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _closed(closed: Any, config: _Config) -> Callable[..., list]:
  """A function evaluating a ClosedJaxpr with autocast."""
  return lambda *args: _eval(closed.jaxpr, closed.consts, list(args), config)


def _bind(eqn: Any, invals: list) -> Any:
  params = eqn.primitive.get_bind_params(eqn.params)
  return eqn.primitive.bind(*invals, **params)


def _overridden(eqn: Any) -> bool:
  return OVERRIDE_SCOPE in str(eqn.source_info.name_stack)


def _eval_eqn(eqn: Any, invals: list, config: _Config) -> Any:
  name = eqn.primitive.name
  avals = [v.aval for v in eqn.invars]
  as_written = lambda: _bind(eqn, _as_written(invals, avals))  # noqa: E731
  if _overridden(eqn):
    return as_written()
  rule = config.lists.rule(name)
  structural = _STRUCTURAL.get(name)
  if structural is not None:
    return (
      as_written() if rule == "as_written" else structural(eqn, invals, config)
    )
  if rule == "as_written" or any(
    hasattr(a, "dtype") and _is_fp8_dtype(a.dtype) for a in avals
  ):
    return as_written()
  if list(jex_core.jaxprs_in_params(eqn.params)):
    if rule != "promote":
      raise ValueError(
        f"autocast: primitive {name!r} is on the {rule} list, but it "
        "carries a jaxpr (its combiner or body), which autocast runs as "
        "written; take it off that list (or put it on as_written)."
      )
    return as_written()  # a higher-order primitive autocast cannot open
  if rule == "passthrough":
    return _bind(eqn, invals)
  if rule == "float32":
    return _bind(
      eqn,
      [
        _cast(x, jnp.promote_types(_dtype(x), jnp.float32))
        if _castable(_dtype(x))
        else x
        for x in invals
      ],
    )
  if rule == "compute":
    return _compute(eqn, invals, avals, config)
  dtype = _promoted(invals, eqn.invars)
  if dtype is None:
    return _bind(eqn, invals)
  fill = eqn.params.get("fill_value")  # gather's, for out-of-bounds rows
  if fill is not None and _overflows(fill, dtype):
    return as_written()
  return _bind(eqn, [_cast(x, dtype) for x in invals])


def _overflows(value: Any, dtype: Any) -> bool:
  """Whether finite `value` becomes inf in `dtype` (-1e30 in float16)."""
  value = np.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    return False
  with np.errstate(over="ignore"):
    return bool(
      np.all(np.isfinite(value))
      and not np.all(np.isfinite(value.astype(dtype)))
    )


def _explicit_precision(precision: Any) -> bool:
  """A matmul precision the program asked for (an algorithm, HIGH,
  HIGHEST), which operands in a narrower dtype would not honour."""
  if precision is None:
    return False
  if isinstance(precision, (tuple, list)):
    return any(_explicit_precision(p) for p in precision)
  return precision != lax.Precision.DEFAULT


_ABSENT = object()


def _compute(eqn: Any, invals: list, avals: list, config: _Config) -> Any:
  """A matmul or convolution in the compute dtype."""
  # The two matmul operands: an integer one (a quantized matmul) or a
  # float64 one (torch leaves those too) keeps the op as it is. Further
  # operands (ragged_dot's group sizes) are never cast.
  dtypes = [_dtype(x) for x in invals[:2]]
  if not all(_castable(d) for d in dtypes) or any(
    d == np.dtype(jnp.float64) for d in dtypes
  ):
    return _bind(eqn, invals)
  params = dict(eqn.params)
  if _explicit_precision(params.get("precision")):
    # An algorithm or HIGHEST the program asked for: as written.
    return _bind(eqn, _as_written(invals, avals))
  traced = functools.reduce(jnp.promote_types, [a.dtype for a in avals])
  preferred = params.get("preferred_element_type", _ABSENT)
  if preferred is None or (
    preferred is not _ABSENT and np.dtype(preferred) == np.dtype(traced)
  ):
    # The product in the compute dtype; an explicitly wider output (say
    # bfloat16 operands with a float32 result) is kept.
    params["preferred_element_type"] = config.compute_dtype
  invals = [_cast(x, config.compute_dtype) for x in invals[:2]] + invals[2:]
  return eqn.primitive.bind(*invals, **params)


# --- higher-order primitives ----------------------------------------------


def _constrain(x: Any, sharding: Any) -> Any:
  """`x` laid out as a jit's explicit `sharding` asks (none: as it is)."""
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return x
  auto = jax.sharding.AxisType.Auto
  if all(t == auto for t in sharding.mesh.axis_types):
    return jax.lax.with_sharding_constraint(x, sharding)
  return jax.sharding.reshard(x, sharding)  # Explicit axes: a layout change


def _jit(eqn, invals, config):
  params = eqn.params

  def constrain(values, shardings):
    return [_constrain(x, s) for x, s in zip(values, shardings, strict=True)]

  invals = constrain(invals, params["in_shardings"])
  outs = _closed(params["jaxpr"], config)(*invals)
  return constrain(outs, params["out_shardings"])


def _closed_call(eqn, invals, config):
  return _closed(eqn.params["call_jaxpr"], config)(*invals)


def _checkpoint(eqn, invals, config):
  jaxpr = eqn.params["jaxpr"]
  body = lambda *args: _eval(jaxpr, [], list(args), config)  # noqa: E731
  remat = jax.checkpoint(
    body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
  )
  return remat(*invals)


def _scan(eqn, invals, config):
  params = eqn.params
  closed = params["jaxpr"]
  n_consts, n_carry = params["num_consts"], params["num_carry"]
  consts = invals[:n_consts]
  carry_avals = closed.in_avals[n_consts : n_consts + n_carry]
  init = _as_written(invals[n_consts : n_consts + n_carry], carry_avals)
  xs = invals[n_consts + n_carry :]

  def body(carry, x):
    outs = _eval(closed.jaxpr, closed.consts, [*consts, *carry, *x], config)
    return _as_written(outs[:n_carry], carry_avals), outs[n_carry:]

  carry, ys = lax.scan(
    body,
    init,
    xs,
    length=params["length"],
    reverse=params["reverse"],
    unroll=params["unroll"],
  )
  return [*carry, *ys]


def _while(eqn, invals, config):
  params = eqn.params
  cond, body = params["cond_jaxpr"], params["body_jaxpr"]
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  cond_consts, body_consts = invals[:nc], invals[nc : nc + nb]
  carry_avals = body.out_avals
  init = _as_written(invals[nc + nb :], carry_avals)

  def cond_fn(carry):
    return _eval(cond.jaxpr, cond.consts, [*cond_consts, *carry], config)[0]

  def body_fn(carry):
    outs = _eval(body.jaxpr, body.consts, [*body_consts, *carry], config)
    return _as_written(outs, carry_avals)

  return list(lax.while_loop(cond_fn, body_fn, init))


def _cond(eqn, invals, config):
  index, *operands = invals
  branches = [_closed(b, config) for b in eqn.params["branches"]]
  shapes = [jax.eval_shape(b, *operands) for b in branches]
  dtypes = [
    functools.reduce(jnp.promote_types, [s.dtype for s in outs])
    if _castable(outs[0].dtype)
    else None
    for outs in zip(*shapes, strict=True)
  ]

  def agreeing(branch):
    return lambda *args: _cast_outputs(branch(*args), dtypes)

  return list(lax.switch(index, [agreeing(b) for b in branches], *operands))


def _shard_map(eqn, invals, config):
  params = eqn.params
  jaxpr = params["jaxpr"]
  body = lambda *args: tuple(_eval(jaxpr, [], list(args), config))  # noqa: E731
  mapped = jax.shard_map(
    body,
    mesh=params["mesh"],
    in_specs=tuple(params["in_specs"]),
    out_specs=tuple(params["out_specs"]),
    axis_names=set(params["newly_manual_axes"]),
    check_vma=params["check_vma"],
  )
  return list(mapped(*invals))


def _instantiate(x: Any, aval: Any) -> Any:
  """A symbolic zero as an array of `aval`'s shape and dtype."""
  if isinstance(x, ad_util.Zero):
    return jnp.zeros(aval.shape, aval.dtype)
  return x


def _zero_tangent(shape: Any) -> Any:
  """The zero tangent of an output: float0 for integer and bool outputs."""
  if jnp.issubdtype(shape.dtype, jnp.inexact):
    return jnp.zeros(shape.shape, shape.dtype)
  return np.zeros(shape.shape, jax.dtypes.float0)


def _custom_jvp(eqn, invals, config):
  params = eqn.params
  call = params["call_jaxpr"]
  if _contains_fp8(call):
    return _bind(eqn, _as_written(invals, [v.aval for v in eqn.invars]))
  n_consts = params["num_consts"]
  consts, primals = invals[:n_consts], invals[n_consts:]
  primal_avals = call.in_avals[n_consts:]
  # Inputs with a tangent: float and complex ones (ints and bools have none).
  floats = [jnp.issubdtype(a.dtype, jnp.inexact) for a in primal_avals]

  def primal(*args):
    return _eval(call.jaxpr, call.consts, [*consts, *args], config)

  fn = jax.custom_jvp(primal)

  @fn.defjvp
  def rule(primals, tangents):
    out_shapes = jax.eval_shape(primal, *primals)
    # The JVP jaxpr for inexact tangents given, integer ones zero.
    zeros = [not f for f in floats]
    jvp_jaxpr, jvp_consts, out_zeros = params["jvp_jaxpr_fun"].call_wrapped(
      *zeros
    )
    nonzero = [t for t, f in zip(tangents, floats, strict=True) if f]
    outs = _eval(jvp_jaxpr, jvp_consts, [*primals, *nonzero], config)
    n_out = len(out_zeros)
    dtypes = [s.dtype for s in out_shapes]
    primals_out = _cast_outputs(outs[:n_out], dtypes)
    nonzero_out = iter(outs[n_out:])
    tangents_out = [
      _zero_tangent(s) if z else _cast(next(nonzero_out), s.dtype)
      for s, z in zip(out_shapes, out_zeros, strict=True)
    ]
    return primals_out, tangents_out

  return fn(*primals)


def _custom_vjp(eqn, invals, config):
  params = eqn.params
  call = params["call_jaxpr"]
  if _contains_fp8(call):
    return _bind(eqn, _as_written(invals, [v.aval for v in eqn.invars]))
  n_consts = params["num_consts"]
  consts, primals = invals[:n_consts], invals[n_consts:]
  primal_avals = call.in_avals[n_consts:]
  out_avals = call.out_avals

  def primal(*args):
    return _eval(call.jaxpr, call.consts, [*consts, *args], config)

  fn = jax.custom_vjp(primal)

  def fwd(*args):
    fwd_jaxpr, fwd_consts = params["fwd_jaxpr_thunk"].call_wrapped(
      *[True] * len(args)
    )
    outs = _eval(fwd_jaxpr, fwd_consts, list(args), config)
    _, res_tree, input_fwds = params["out_trees"]()
    n_res = res_tree.num_leaves - sum(f is not None for f in input_fwds)
    res_out, primals_out = outs[:n_res], outs[n_res:]
    res_avals = [v.aval for v in fwd_jaxpr.outvars[:n_res]]
    # The residuals in the dtypes bwd was traced with.
    res_iter = iter(_as_written(res_out, res_avals))
    written = _as_written(list(args), primal_avals)
    res = [next(res_iter) if f is None else written[f] for f in input_fwds]
    return primals_out, res

  def bwd(res, cts):
    res_avals = [jax.typeof(r) for r in res]
    cts = _as_written(list(cts), out_avals)

    def written_bwd(*args):
      grads = params["bwd"].call_wrapped(*args)
      return [
        _instantiate(g, a) for g, a in zip(grads, primal_avals, strict=True)
      ]

    bwd_jaxpr = jax.make_jaxpr(written_bwd)(
      *res_avals, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
    )
    grads = _closed(bwd_jaxpr, config)(*res, *cts)
    return tuple(
      _cast(g, _dtype(p)) for g, p in zip(grads, primals, strict=True)
    )

  fn.defvjp(fwd, bwd)
  return fn(*primals)


_STRUCTURAL: dict[str, Callable[..., Any]] = {
  "jit": _jit,
  "pjit": _jit,
  "closed_call": _closed_call,
  "core_call": _closed_call,
  "checkpoint": _checkpoint,
  "remat2": _checkpoint,
  "scan": _scan,
  "while": _while,
  "cond": _cond,
  "shard_map": _shard_map,
  "custom_jvp_call": _custom_jvp,
  "custom_vjp_call": _custom_vjp,
}
assert set(_STRUCTURAL) == STRUCTURAL


# --- the public function --------------------------------------------------


def _is_array(x: Any) -> bool:
  """A traced argument: jax and NumPy arrays (NumPy scalars, like Python
  ones, reach `fn` as they are)."""
  return isinstance(x, (jax.Array, np.ndarray))


def _is_graph_node(x: Any) -> bool:
  from flax import nnx  # noqa: PLC0415 (only where NNX objects can appear)

  return isinstance(x, (nnx.Module, nnx.Rngs, nnx.Variable))


def autocast(
  fn: Callable[..., Any],
  policy: policy_lib.Policy | str,
  *,
  lists: AutocastLists | None = None,
) -> Callable[..., Any]:
  """`fn` computed per operation in the precision torch.autocast would use.

  The returned function has `fn`'s signature. Each call traces `fn` to a
  jaxpr and evaluates it with every primitive's float operands cast by
  `lists` (see `AutocastLists`): matmuls and convolutions in
  `policy.compute_dtype`, exp/log/pow/rsqrt/sums/maxima in float32, other
  ops in the promoted dtype of their inputs. Arguments are not cast: params
  keep the dtype they are stored in (master weights and the param dtype are
  `mixed_precision`'s business), and each matmul casts its operands. Float
  outputs are cast to `policy.output_dtype`.

  Pseudocode:

      for eqn in make_jaxpr(fn)(*args).eqns:
        if eqn.primitive in lists.compute:  operands -> compute_dtype
        elif in lists.float32:             operands -> float32
        elif in lists.passthrough:         operands as they come
        elif in lists.as_written:          operands -> dtypes traced
        else:                              operands -> promoted dtype
        # int, bool, complex, FP8: never cast; an FP8 op runs as written

  It goes through `jit`, `scan`, `while_loop`, `cond`, `checkpoint`,
  `shard_map` and `custom_jvp`/`custom_vjp` functions (their rules kept);
  loop carries keep the dtype they were traced with. `jax.grad` of the
  result differentiates the autocast computation. An inner autocast (say
  with a float32 policy) and a wrapped module's policy override run as they
  trace: the innermost policy wins.

  Array arguments (jax and NumPy arrays) are traced; anything else (Python
  and NumPy scalars and flags, strings, functions) reaches `fn` as it is.
  `flax.nnx` modules, `Rngs` and variables may be arguments, and `fn` may
  be a module: their state is traced, and the variables `fn` changes (batch
  statistics, RNG counts) are written back after the call, in the dtypes
  they had. Call the result inside `jax.jit`: outside, each call traces `fn`
  and runs op by op.

  Args:
    fn: any function of arrays (and NNX objects) returning arrays.
    policy: a `Policy` or a policy string; its compute dtype (bfloat16,
      float16 or float32) is what the `compute` list runs in.
    lists: the op lists; `AutocastLists()` by default.

  Returns:
    A function with `fn`'s signature.

  Raises:
    TypeError: if `fn` is not callable or `lists` is not an AutocastLists.
    ValueError: if the compute dtype is not bfloat16, float16 or float32.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> def loss(w, x):
    ...   return jnp.mean(jax.nn.logsumexp(x @ w, axis=-1))
    >>> f = autocast(loss, "p=f32,c=bf16,o=f32")
    >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    >>> [e.params["preferred_element_type"] for e in jax.make_jaxpr(f)(w, x).eqns
    ...  if e.primitive.name == "dot_general"]
    [dtype(bfloat16)]
    >>> f(w, x)
    Array(5.0986123, dtype=float32)
  """
  if not callable(fn):
    raise TypeError(f"autocast: fn must be callable, got {fn!r}.")
  policy = policy_lib.get_policy(policy)
  compute = np.dtype(policy.compute_dtype)
  if compute not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)) and (
    compute != np.dtype(jnp.float32)
  ):
    raise ValueError(
      f"autocast: policy compute dtype {compute.name} is not accepted; use "
      "bfloat16, float16 or float32 (FP8 runs through fp8 layers)."
    )
  lists = AutocastLists() if lists is None else lists
  if not isinstance(lists, AutocastLists):
    raise TypeError(f"autocast: lists must be an AutocastLists, got {lists!r}.")
  config = _Config(compute, lists)
  if _is_graph_node(fn):
    # An NNX module as the function: its state is traced like an argument's.
    module = fn
    call = autocast(lambda m, *a, **k: m(*a, **k), policy, lists=lists)
    return functools.wraps(type(module).__call__)(
      lambda *args, **kwargs: call(module, *args, **kwargs)
    )

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    from flax import nnx  # noqa: PLC0415

    flat, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_graph_node)
    nodes = [i for i, x in enumerate(flat) if _is_graph_node(x)]
    graph, state = nnx.split(tuple(flat[i] for i in nodes))
    dynamic = [i for i, x in enumerate(flat) if _is_array(x)]

    def pure(state, arrays):
      values = list(flat)
      for i, x in zip(dynamic, arrays, strict=True):
        values[i] = x
      merged = nnx.merge(graph, state) if nodes else ()
      for i, node in zip(nodes, merged, strict=True):
        values[i] = node
      a, k = jax.tree.unflatten(treedef, values)
      out = fn(*a, **k)
      new_state = nnx.split(merged)[1] if nodes else state
      return out, nnx.to_pure_dict(new_state) if nodes else new_state

    arrays = [flat[i] for i in dynamic]
    pure_state = nnx.to_pure_dict(state) if nodes else state
    closed, shapes = jax.make_jaxpr(pure, return_shape=True)(pure_state, arrays)
    inputs = jax.tree.leaves((pure_state, arrays))
    # An autocast (or a wrapped module with an override) traced inside
    # another autocast runs as its own policy made it: the innermost wins.
    with jax.named_scope(OVERRIDE_SCOPE):
      outs = _eval(closed.jaxpr, closed.consts, inputs, config)
    out, new_state = jax.tree.unflatten(jax.tree.structure(shapes), outs)
    if nodes:
      _write_back(
        tuple(flat[i] for i in nodes), state, pure_state, new_state, shapes[1]
      )
    return policy.cast_to_output(out)

  return wrapped


def _write_back(nodes, state, before, after, traced) -> None:
  """The NNX variables `fn` changed, written back in the dtypes they had (a
  batch statistic stays float32); the others are left alone, so a module
  of an outer trace that `fn` only reads is never written."""
  from flax import nnx  # noqa: PLC0415

  flat = nnx.traversals.flatten_mapping
  old, new, shapes = flat(before), flat(after), flat(traced)
  changed = {p for p, x in new.items() if p not in old or x is not old[p]}
  if not changed:
    return
  new = {p: _cast(x, shapes[p].dtype) for p, x in new.items()}
  nnx.replace_by_pure_dict(state, nnx.traversals.unflatten_mapping(new))
  nnx.update(nodes, state.filter(lambda path, _: tuple(path) in changed))

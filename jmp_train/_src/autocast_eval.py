"""The autocast interpreter: a jaxpr evaluated again, one primitive at a
time, with each primitive's float operands cast by the list that names it.

`jmp_train.autocast` (`autocast.py`) traces a function and hands its jaxpr
here. The rules, per equation:

* inside a region with a policy of its own (`OVERRIDE_SCOPE` in its name
  stack: a wrapped module's override, an inner autocast): as written;
* a higher-order primitive (`STRUCTURAL`): evaluated structurally, its body
  by these rules (`as_written` on the lists: the whole call as traced);
* `as_written`, an FP8 operand, or a jaxpr in its params: as written;
* `passthrough`: operands as they come;
* `float32`: low-precision float operands in float32;
* `compute`: the two matmul operands in the compute dtype, and the product
  (unless an operand is an integer or float64, or the precision is
  explicit);
* anything else: float operands in their promoted dtype, literal constants
  weak unless the dtype would overflow them; as written where the program
  gave its float operands different dtypes (a kernel that takes each so).
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

from jmp_train._src import leaves
from jmp_train._src import policy as policy_lib
from jmp_train._src.autocast_lists import STRUCTURAL, AutocastLists

# Where a policy of its own runs (linen.wrap and nnx.wrap overrides, an
# inner autocast): what is traced inside runs as written.
OVERRIDE_SCOPE = policy_lib.OVERRIDE_SCOPE


# --- the dtype rules ------------------------------------------------------


def _dtype(x: Any) -> Any:
  return jax.typeof(x).dtype


def cast(x: Any, dtype: Any) -> Any:
  """`x` in `dtype` if it is a float16/bfloat16/float32/float64 value of
  another dtype (`leaves.is_real_float`, the rule policies cast by:
  integers, booleans, complex, FP8 and PRNG keys are never cast)."""
  if leaves.is_real_float(jax.typeof(x)) and _dtype(x) != np.dtype(dtype):
    return lax.convert_element_type(x, dtype)
  return x


def _as_written(values: list, avals: list) -> list:
  """`values` cast back to the dtypes `avals` were traced with."""
  return [
    cast(v, a.dtype) if leaves.is_real_float(a) else v
    for v, a in zip(values, avals, strict=True)
  ]


def _promoted(values: list, atoms: list) -> np.dtype | None:
  """The widest dtype of the float operands.

  Constants of the program (jaxpr literals: `0.0` in `max(x, 0.0)`, an
  epsilon) and weak-typed values count only when every float operand is one,
  as a Python scalar does in JAX's promotion; except a constant that the
  dtype would turn from finite into inf (`-1e30` in float16) or from nonzero
  into zero (`1e-9` in float16), which widens it instead.
  """
  floats = [
    (v, a)
    for v, a in zip(values, atoms, strict=True)
    if leaves.is_real_float(jax.typeof(v))
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
    if isinstance(a, jex_core.Literal) and _lost(a.val, dtype):
      dtype = jnp.promote_types(dtype, np.asarray(a.val).dtype)
  return np.dtype(dtype)


def _cast_outputs(values: list, dtypes: list) -> list:
  return [
    cast(v, d) if d is not None else v
    for v, d in zip(values, dtypes, strict=True)
  ]


@dataclasses.dataclass(frozen=True)
class Config:
  """What the interpreter casts to, and by which lists."""

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
  return any(leaves.is_float8(v.aval) for v in variables)


# --- the interpreter ------------------------------------------------------


def evaluate(jaxpr: Any, consts: list, args: list, config: Config) -> list:
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


def _closed(closed: Any, config: Config) -> Callable[..., list]:
  """A function evaluating a ClosedJaxpr with autocast."""
  return lambda *args: evaluate(closed.jaxpr, closed.consts, list(args), config)


def _bind(eqn: Any, invals: list) -> Any:
  params = eqn.primitive.get_bind_params(eqn.params)
  return eqn.primitive.bind(*invals, **params)


def _overridden(eqn: Any) -> bool:
  return OVERRIDE_SCOPE in str(eqn.source_info.name_stack)


def _eval_eqn(eqn: Any, invals: list, config: Config) -> Any:
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
  if rule == "as_written" or any(leaves.is_float8(a) for a in avals):
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
        cast(x, jnp.promote_types(_dtype(x), jnp.float32))
        if leaves.is_real_float(jax.typeof(x))
        else x
        for x in invals
      ],
    )
  if rule == "compute":
    return _compute(eqn, invals, avals, config)
  if len({a.dtype for a in avals if leaves.is_real_float(a)}) > 1:
    # Float operands the program gave different dtypes (cuDNN attention's
    # backward: bfloat16 q, k and v, float32 softmax statistics; a
    # callback's): the primitive takes each in its own, so promoting them
    # to one would change what was written. As written.
    return as_written()
  dtype = _promoted(invals, eqn.invars)
  if dtype is None:
    return _bind(eqn, invals)
  fill = eqn.params.get("fill_value")  # gather's, for out-of-bounds rows
  if fill is not None and _lost(fill, dtype):
    return as_written()
  return _bind(eqn, [cast(x, dtype) for x in invals])


def _lost(value: Any, dtype: Any) -> bool:
  """Whether `dtype` turns finite `value` into inf (-1e30 in float16) or a
  nonzero one into zero (1e-9 in float16): a floor of -1e30 or a division
  by 1e-9 would then give inf, a product with 1e-9 zeros."""
  value = np.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    return False
  with np.errstate(over="ignore", under="ignore"):
    narrow = value.astype(dtype)
    overflows = np.isfinite(value) & ~np.isfinite(narrow)
    flushed = (value != 0) & (narrow == 0)
  return bool(np.any(overflows | flushed))


def _explicit_precision(precision: Any) -> bool:
  """A matmul precision the program asked for (an algorithm, HIGH,
  HIGHEST), which operands in a narrower dtype would not honour."""
  if precision is None:
    return False
  if isinstance(precision, (tuple, list)):
    return any(_explicit_precision(p) for p in precision)
  return precision != lax.Precision.DEFAULT


_ABSENT = object()


def _compute(eqn: Any, invals: list, avals: list, config: Config) -> Any:
  """A matmul or convolution in the compute dtype."""
  # The two matmul operands: an integer one (a quantized matmul) or a
  # float64 one (torch leaves those too) keeps the op as it is. Further
  # operands (ragged_dot's group sizes) are never cast.
  operands = [jax.typeof(x) for x in invals[:2]]
  if not all(leaves.is_real_float(a) for a in operands) or any(
    a.dtype == np.dtype(jnp.float64) for a in operands
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
  invals = [cast(x, config.compute_dtype) for x in invals[:2]] + invals[2:]
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
  body = lambda *args: evaluate(jaxpr, [], list(args), config)  # noqa: E731
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
    outs = evaluate(closed.jaxpr, closed.consts, [*consts, *carry, *x], config)
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
    return evaluate(cond.jaxpr, cond.consts, [*cond_consts, *carry], config)[0]

  def body_fn(carry):
    outs = evaluate(body.jaxpr, body.consts, [*body_consts, *carry], config)
    return _as_written(outs, carry_avals)

  return list(lax.while_loop(cond_fn, body_fn, init))


def _cond(eqn, invals, config):
  index, *operands = invals
  branches = [_closed(b, config) for b in eqn.params["branches"]]
  shapes = [jax.eval_shape(b, *operands) for b in branches]
  dtypes = [
    functools.reduce(jnp.promote_types, [s.dtype for s in outs])
    if leaves.is_real_float(outs[0])
    else None
    for outs in zip(*shapes, strict=True)
  ]

  def agreeing(branch):
    return lambda *args: _cast_outputs(branch(*args), dtypes)

  return list(lax.switch(index, [agreeing(b) for b in branches], *operands))


def _shard_map(eqn, invals, config):
  params = eqn.params
  jaxpr = params["jaxpr"]
  body = lambda *args: tuple(evaluate(jaxpr, [], list(args), config))  # noqa: E731
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


def _custom_primal(eqn, invals, config):
  """A custom_jvp/custom_vjp call's primal function, autocast (closed over
  its consts, as JAX treats them), its primal arguments and their avals."""
  call, n_consts = eqn.params["call_jaxpr"], eqn.params["num_consts"]
  consts, primals = invals[:n_consts], invals[n_consts:]

  def primal(*args):
    return evaluate(call.jaxpr, call.consts, [*consts, *args], config)

  return primal, primals, call.in_avals[n_consts:]


def _custom_jvp(eqn, invals, config):
  params = eqn.params
  if _contains_fp8(params["call_jaxpr"]):
    return _bind(eqn, _as_written(invals, [v.aval for v in eqn.invars]))
  primal, primals, primal_avals = _custom_primal(eqn, invals, config)
  # Inputs with a tangent: float and complex ones (ints and bools have none).
  floats = [jnp.issubdtype(a.dtype, jnp.inexact) for a in primal_avals]
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
    outs = evaluate(jvp_jaxpr, jvp_consts, [*primals, *nonzero], config)
    n_out = len(out_zeros)
    dtypes = [s.dtype for s in out_shapes]
    primals_out = _cast_outputs(outs[:n_out], dtypes)
    nonzero_out = iter(outs[n_out:])
    tangents_out = [
      _zero_tangent(s) if z else cast(next(nonzero_out), s.dtype)
      for s, z in zip(out_shapes, out_zeros, strict=True)
    ]
    return primals_out, tangents_out

  return fn(*primals)


def _custom_vjp(eqn, invals, config):
  params = eqn.params
  if _contains_fp8(params["call_jaxpr"]):
    return _bind(eqn, _as_written(invals, [v.aval for v in eqn.invars]))
  primal, primals, primal_avals = _custom_primal(eqn, invals, config)
  out_avals = params["call_jaxpr"].out_avals
  fn = jax.custom_vjp(primal)

  def fwd(*args):
    fwd_jaxpr, fwd_consts = params["fwd_jaxpr_thunk"].call_wrapped(
      *[True] * len(args)
    )
    outs = evaluate(fwd_jaxpr, fwd_consts, list(args), config)
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

    # Traced with the cotangents' own types: inside shard_map a cotangent
    # that varies over a manual axis must be traced as varying, or bwd's
    # operations between it and a constant fail the replication check.
    bwd_jaxpr = jax.make_jaxpr(written_bwd)(
      *res_avals, *[jax.typeof(c) for c in cts]
    )
    grads = _closed(bwd_jaxpr, config)(*res, *cts)
    return tuple(
      cast(g, _dtype(p)) for g, p in zip(grads, primals, strict=True)
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

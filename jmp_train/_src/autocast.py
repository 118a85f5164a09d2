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
  on no list; a primitive `fn` gave float operands of different dtypes
  (cuDNN attention's backward: bfloat16 q, k, v and float32 statistics)
  takes each in its own, so it runs as written.

Integer, boolean, complex and FP8 values are never cast. A primitive with an
FP8 operand, and a `custom_jvp`/`custom_vjp` function that computes with FP8
values (jmp_train's FP8 matmuls), runs as written. So does a matmul with an
explicit precision, and everything traced inside a region with a policy of
its own: a `linen.wrap`/`nnx.wrap` module with a policy override, or an inner
`autocast` (both open the name scope `OVERRIDE_SCOPE`). The innermost policy
wins.

Higher-order primitives are evaluated structurally, with their bodies
autocast: `jit` (inlined, its explicit shardings kept),
`checkpoint` (`jax.checkpoint` with the same policy), `scan`, `while` and
`cond` (loop carries keep the dtype they were traced with; `cond` branches
agree on the promoted dtype of each output), `shard_map`, and `custom_jvp` /
`custom_vjp` functions, whose custom rules are kept: the JVP rule is
evaluated with the same lists, and the VJP's `bwd` gets residuals and
cotangents in the dtypes it was traced with, its jaxpr autocast too. Any
other primitive that carries a jaxpr runs as written.

Why a jaxpr interpreter rather than a tracer that casts on the fly: the
jaxpr is the program as JAX sees it, whichever library built it (Flax, plain
jax.numpy or another), and it names every primitive, so the lists are the
whole contract. The interpreter is `autocast_eval.py`; this module handles
the arguments (arrays traced, NNX objects split and written back) and the
outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_train._src import policy as policy_lib
from jmp_train._src.autocast_eval import OVERRIDE_SCOPE, Config, cast, evaluate
from jmp_train._src.autocast_lists import AutocastLists

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
  if _is_graph_node(fn):
    # An NNX module as the function: its state is traced like an argument's.
    module = fn
    call = autocast(lambda m, *a, **k: m(*a, **k), policy, lists=lists)
    return functools.wraps(type(module).__call__)(
      lambda *args, **kwargs: call(module, *args, **kwargs)
    )
  policy = policy_lib.get_policy(policy)
  compute = np.dtype(policy.compute_dtype)
  if compute not in map(np.dtype, (jnp.bfloat16, jnp.float16, jnp.float32)):
    raise ValueError(
      f"autocast: policy compute dtype {compute.name} is not accepted; use "
      "bfloat16, float16 or float32 (FP8 runs through fp8 layers)."
    )
  lists = AutocastLists() if lists is None else lists
  if not isinstance(lists, AutocastLists):
    raise TypeError(f"autocast: lists must be an AutocastLists, got {lists!r}.")
  config = Config(compute, lists)

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
      outs = evaluate(closed.jaxpr, closed.consts, inputs, config)
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
  # A variable's value may be a pytree of its own (an FP8 layer's
  # `Fp8DotState`): each of its arrays goes back in its traced dtype.
  new = {
    p: jax.tree.map(lambda a, s: cast(a, s.dtype), x, shapes[p])
    for p, x in new.items()
  }
  nnx.replace_by_pure_dict(state, nnx.traversals.unflatten_mapping(new))
  nnx.update(
    nodes, nnx.filter_state(state, lambda path, _: tuple(path) in changed)
  )

"""The op lists of `jmp_train.autocast`: which primitives run in which
precision, by name, as torch.autocast's op reference lists its ops.

torch.autocast has a "lower precision" list (matmuls, convolutions,
`linear`), a float32 list (exp, log, pow, rsqrt, softmax, norms, losses,
sums) and runs every other op in the widest type of its inputs. These are
the same lists for JAX primitives, the names `jax.make_jaxpr` prints; a
primitive on no list whose float operands the program gave different
dtypes runs as written (a kernel such as cuDNN attention's backward takes
each in its own).
Softmax, log-softmax, layer norm and the losses are no primitives in JAX:
they are built from exp, log, reduce_max, reduce_sum and rsqrt, which the
float32 list holds, and their divisions take a float32 operand from those,
so they run in float32 by promotion.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable

from jax.extend import core as jex_core

DEFAULT_COMPUTE = frozenset({"dot_general", "conv_general_dilated"})

DEFAULT_FLOAT32 = frozenset(
  {
    # torch.autocast's float32 list: transcendental and power functions
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "logistic",
    "erf",
    "erfc",
    "erf_inv",
    "pow",
    "integer_pow",
    "square",
    "sqrt",
    "rsqrt",
    "tan",
    "acos",
    "asin",
    "cosh",
    "sinh",
    "lgamma",
    "digamma",
    # reductions and scans over floats (norms, softmax, losses)
    "reduce_sum",
    "reduce_prod",
    "reduce_max",
    "reduce_min",
    "cumsum",
    "cumprod",
    "cumlogsumexp",
    # torch.autocast's float32 list has fft and linalg ops too: their
    # kernels take float32 or wider (bfloat16 is refused on CPU)
    "fft",
    "complex",
    "cholesky",
    "eigh",
    "eig",
    "svd",
    "qr",
    "geqrf",
    "geqp3",
    "householder_product",
    "lu",
    "triangular_solve",
    "schur",
    "hessenberg",
    "tridiagonal",
    "tridiagonal_solve",
  }
)

DEFAULT_PASSTHROUGH = frozenset(
  {
    "psum",
    "pmax",
    "pmin",
    "all_gather",
    "all_to_all",
    "ppermute",
    "psum_scatter",
    "reduce_scatter",
    "pbroadcast",
    "pvary",
    "optimization_barrier",
    "device_put",
    "sharding_constraint",
    "mesh_cast",
    "reshard",
    "name",
  }
)

# Kernels that take the dtypes they were written with: callbacks, XLA FFI
# calls and cuDNN's attention (the names JAX 0.10 gives its primitives).
DEFAULT_AS_WRITTEN = frozenset(
  {
    "bitcast_convert_type",
    "pure_callback",
    "io_callback",
    "debug_callback",
    "debug_print",
    "ffi_call",
    "dot_product_attention_fwd_wrapper",
    "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_fwd_wrapper",
    "dot_product_attention_fp8_bwd_wrapper",
  }
)

_LIST_NAMES = ("compute", "float32", "passthrough", "as_written")

# Primitives autocast evaluates structurally, their bodies by the lists. The
# only list they may be on is as_written (the whole call as traced).
STRUCTURAL = frozenset(
  {
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "checkpoint",
    "remat2",
    "scan",
    "while",
    "cond",
    "shard_map",
    "custom_jvp_call",
    "custom_vjp_call",
  }
)


def _known_primitives() -> frozenset[str]:
  """The names of the primitives loaded now (JAX's and any library's)."""
  names = set()
  for module in list(sys.modules.values()):
    for value in list(getattr(module, "__dict__", {}).values()):
      if isinstance(value, jex_core.Primitive):
        names.add(value.name)
  return frozenset(names)


@dataclasses.dataclass(frozen=True)
class AutocastLists:
  """Which primitives autocast runs in which precision, by name.

  Mirrors torch.autocast's op lists (its "lower precision", "float32" and
  "promote" lists) for JAX primitives. A primitive on no list runs in the
  promoted dtype of its float operands, or as written where the program
  gave them different dtypes. Change a list with
  `dataclasses.replace` or `with_ops`.

  Attributes:
    compute: primitives run in the policy's compute dtype.
    float32: primitives run in float32 (float64 operands stay float64).
    passthrough: primitives whose operands are not cast at all.
    as_written: primitives run with operands in the dtypes traced.

  Example:
    >>> lists = AutocastLists().with_ops(float32={"tanh"})
    >>> "tanh" in lists.float32, "exp" in lists.float32
    (True, True)
  """

  compute: frozenset[str] = DEFAULT_COMPUTE
  float32: frozenset[str] = DEFAULT_FLOAT32
  passthrough: frozenset[str] = DEFAULT_PASSTHROUGH
  as_written: frozenset[str] = DEFAULT_AS_WRITTEN

  def __post_init__(self):
    # A frozen dataclass is not a pytree: this runs when a user builds one,
    # never on unflatten.
    seen: dict[str, str] = {}
    for field in _LIST_NAMES:
      value = getattr(self, field)
      if isinstance(value, str) or not isinstance(value, Iterable):
        raise TypeError(
          f"AutocastLists.{field} must be a set of primitive names, got "
          f"{value!r}."
        )
      names = frozenset(value)
      for name in names:
        if not isinstance(name, str):
          raise TypeError(
            f"AutocastLists.{field}: primitive names are strings, got {name!r}."
          )
        if name in seen:
          raise ValueError(
            f"AutocastLists: primitive {name!r} is on both the {seen[name]} "
            f"and the {field} list; put it on one."
          )
        if name in STRUCTURAL and field != "as_written":
          raise ValueError(
            f"AutocastLists.{field}: {name!r} is evaluated structurally (its "
            "body follows the lists); it can only be put on as_written, to "
            "run the whole call as traced."
          )
        seen[name] = field
      object.__setattr__(self, field, names)
    defaults = set().union(
      DEFAULT_COMPUTE, DEFAULT_FLOAT32, DEFAULT_PASSTHROUGH, DEFAULT_AS_WRITTEN
    )
    unknown = set(seen) - defaults
    unknown = sorted(unknown - _known_primitives()) if unknown else []
    if unknown:
      raise ValueError(
        f"AutocastLists: no loaded primitive is named {unknown}; names are "
        "those jax.make_jaxpr prints (e.g. 'dot_general', 'exp', "
        "'reduce_sum', 'tanh')."
      )

  def with_ops(self, **lists: Iterable[str]) -> AutocastLists:
    """These lists with names added: `with_ops(float32={"tanh"})`.

    A name added to one list leaves any other list it was on.
    """
    bad = sorted(set(lists) - set(_LIST_NAMES))
    if bad:
      raise ValueError(
        f"AutocastLists.with_ops: unknown list(s) {bad}; the lists are "
        f"{list(_LIST_NAMES)}."
      )
    for field, names in lists.items():
      if isinstance(names, str) or not isinstance(names, Iterable):
        raise TypeError(
          f"AutocastLists.with_ops: {field} must be a set of primitive "
          f"names, got {names!r} (e.g. {field}={{{names!r}}})."
        )
    added = {name for names in lists.values() for name in names}
    fields = {}
    for field in _LIST_NAMES:
      kept = getattr(self, field) - added
      fields[field] = kept | frozenset(lists.get(field, ()))
    return AutocastLists(**fields)

  def rule(self, name: str) -> str:
    """The list `name` is on, or "promote"."""
    for field in _LIST_NAMES:
      if name in getattr(self, field):
        return field
    return "promote"

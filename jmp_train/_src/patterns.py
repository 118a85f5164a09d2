"""Name patterns that select modules (`fp8_exclude`, `respect_dtype_fields`).

`linen.wrap` and `nnx.wrap` take module classes and glob patterns matched
against a module's name and its "/"-joined path. A pattern that matches no
module of the model selects nothing: a typo that would silently leave a
layer in FP8, or computing in the compute dtype. Both wrappers refuse it
here, each from the modules it can see.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable


def refuse_unmatched(
  argument: str, selectors: Iterable, paths: Iterable[tuple], what: str
) -> None:
  """Raises ValueError for a pattern in `selectors` that selects none of
  `paths` (module paths, tuples of names) by its name or "/"-joined path.

  `what` says which modules `paths` are, for the message.
  """
  paths = list(paths)
  names = [("/".join(map(str, p)), str(p[-1]) if p else "") for p in paths]
  for item in selectors:
    if isinstance(item, str) and not any(
      fnmatch.fnmatchcase(path, item) or fnmatch.fnmatchcase(name, item)
      for path, name in names
    ):
      known = sorted(path for path, _ in names if path)
      shown = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
      raise ValueError(
        f"{argument} pattern {item!r} matches no module of the model, so it "
        "selects nothing. Patterns are glob patterns matched against a "
        f"module's name and its '/'-joined path; this model's {what}: "
        f"{shown}."
      )

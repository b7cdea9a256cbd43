"""A run's surroundings: where it writes, who holds it, how it stops, what it logs, what it checks.

- :mod:`~lowrank_jax.runs.outputs`: output folders that never lose a user's work (checked
  before any work, owned by a marker, written atomically);
- :mod:`~lowrank_jax.runs.lock`: one process per run folder;
- :mod:`~lowrank_jax.runs.signals`: SIGTERM as a request to stop at the next step boundary;
- :mod:`~lowrank_jax.runs.quiet`: the libraries' background noise goes to the run's log;
- :mod:`~lowrank_jax.runs.validate`: checks of user input made before any work;
- :mod:`~lowrank_jax.runs.results`: the result record of a reproduction (JSON + Markdown).

These sit on the ground floor beside :mod:`lowrank_jax.core`: the formats (:mod:`lowrank_jax.io`),
the hub, the trainers and the commands all use them, and they import nothing of the package.
"""

from lowrank_jax.runs.outputs import atomic_write_text, inside, prepare_output, staged_folder
from lowrank_jax.runs.signals import Stopped

__all__ = ["Stopped", "atomic_write_text", "inside", "prepare_output", "staged_folder"]

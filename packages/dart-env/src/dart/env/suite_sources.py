"""The suite sources dart-env registers (entry-point group ``dart.suites``, see :mod:`dart.protocol.suite`):
``builtin:`` for the suites shipped with the backends, ``osworld:<dir>`` for an OSWorld task directory.

Each imports its backend's catalog when called, so resolving a sim suite never imports the browser or
desktop code.
"""

from __future__ import annotations

from dart.protocol.errors import ConfigError
from dart.protocol.suite import TaskSuite


def builtin(name: str) -> TaskSuite:
    """The suite source ``builtin:``: a shipped sim suite (``<name>``), a shipped MiniWoB++ suite
    (``miniwob/<name>``), or the shipped OSWorld-format local-desktop tasks (``osworld/local``).

    Raises:
        ConfigError: No such shipped suite (field ``suite``; the message lists those that exist).
    """
    try:
        if name.startswith("miniwob/"):
            from dart.env.miniwob.catalog import load_builtin_suite as load_miniwob_suite

            return load_miniwob_suite(name.removeprefix("miniwob/"))
        if name == "osworld/local":
            from dart.env.osworld.suites import load_local_suite

            return TaskSuite(name="osworld-local", tasks=tuple(load_local_suite()))
        from dart.env.sim import load_builtin_suite as load_sim_suite

        return load_sim_suite(name)
    except KeyError as exc:
        raise ConfigError("run config", "suite", str(exc.args[0])) from None


def osworld(directory: str) -> TaskSuite:
    """The suite source ``osworld:``: every task of an OSWorld task directory, each with its requirements
    (``app:chrome``, ``metric:compare_table``): the data manager keeps those the env pool reports it runs.

    Raises:
        ConfigError: The directory cannot be read, or holds no task (field ``suite``).
    """
    from dart.env.osworld import OSWorldTaskError, load_osworld_suite

    try:
        return load_osworld_suite(directory)
    except OSWorldTaskError as exc:
        raise ConfigError("run config", "suite", str(exc)) from None

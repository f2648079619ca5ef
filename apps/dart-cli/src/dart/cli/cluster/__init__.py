"""Where ``dart run``'s services run: its own child processes (the default), or actors on a Ray cluster.

- :mod:`dart.cli.cluster.config`: the run config's ``cluster`` section.
- :mod:`dart.cli.cluster.launch`: the seam, :class:`~dart.cli.cluster.launch.Launcher`, that starts a service and
  hands back a process-like handle the supervisor watches, restarts and stops; the local launcher.
- :mod:`dart.cli.cluster.ray_launch`: the Ray launcher (each service an actor that runs ``dart serve`` on its
  node; the trainer a placement group with one bundle per node).
- :mod:`dart.cli.cluster.ray_host`: the actor that runs on a node.
- :mod:`dart.cli.cluster.ray_cluster`: connecting to a cluster, its nodes and resources, the capacity check.
- :mod:`dart.cli.cluster.local_ray`: ``--ray local``, a throwaway cluster of separate Ray nodes on this machine.

Ray places and supervises processes only: every byte between services still goes over NATS and the store.
"""

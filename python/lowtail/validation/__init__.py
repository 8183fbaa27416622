"""Post-deploy validation: static checks of a node's configuration and latency probes on its CPUs.

``check`` holds the record every check produces, ``static`` the configuration checks, ``probes`` the
measurements, ``rttests`` the cyclictest/oslat wrappers, ``runner`` the orchestration, ``report`` the
JSON/table/HTML renderings and ``plots`` the matplotlib figures.
"""

"""Operator tools on top of the store: `hicache-gds doctor` (`doctor`), `ls` / `verify` / `clear`
(`admin`, over `namespaces`) and the load-or-recompute break-even measurement (`breakeven`). The
benchmark, `hicache-gds-bench`, is `hicache_gds.bench`; the command line itself is `hicache_gds.cli`."""

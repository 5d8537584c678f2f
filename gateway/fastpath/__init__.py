"""The fast path: the gateway's own, shorter versions of library code on its hot routes, behind one boundary.

Each part replaces work a library does generically with what the gateway's requests need, measured to pay on a
realistic workload (the figure is in each module's docstring; `benchmarks/ab.py` with `--set-b
RG_FASTPATH__<PART>=false` measures it again), or does what the library offers no public API for (`server_send`,
`server_protocol`: a slow client's connection aborted, connection limits where bytes arrive). The domain modules
never import this package: the wiring does (`gateway.app`, `gateway.services`, `gateway.server`), from
`settings.fastpath`, whose `enabled: false` turns every part off and leaves the gateway on the libraries' public
APIs alone, answering the same. Several parts rely on private names of the libraries they shorten; pyproject.toml
pins those libraries to the tested range and `tests/gateway/fastpath/test_taken.py` fails when a part falls back on
the pinned versions.
"""

"""The daemon's features, each a service in its own module with its own state.

A service is a class whose `routes()` maps request schemas of
`infinity.protocol.wire` to its handlers (see `services.base` for what a
handler takes and returns); `infinity.daemon.server.Daemon` builds each one
with the narrow parts of the daemon it needs (the catalog, the tiers, the
scheduler, another service) and registers its routes with the dispatcher
(`infinity.daemon.dispatch`), which owns the socket. A service that holds
something per session also gives a `client_gone(session)` hook, run when the
session ends.

- `handshake`: sessions: hello, attach, detach, heartbeat, bye, liveness, the fd channel
- `data`: get, get_ahead, release, reserve, commit(s), abort, flush_store, delete, exists,
  list, prefetch
- `streams`: stream_open, stream_chunk, stream_close (on `infinity.daemon.streams`)
- `steps`: step, upcoming, each session's scheduler streams; with `traces` (traces kept
  in the index) and `prefetch` (the plans that follow news)
- `namespaces`: namespace (create, info, seal a namespace record)
- `optimizer`: adam_step (Adam / AdamW run beside the data, on the native task pool)
- `verify`: verify (every flushed tensor's NVMe copy read back against its checksums, online)
- `admin`: stats, shutdown

Next, in a module of its own here, built and registered in `Daemon.__init__` beside
the others (the tuple of services it registers): the model-import service
(inference: loading a model's weights into a read-only namespace). Work a service
does for itself, not for a client, holds what it holds in the catalog as
`sessions.DAEMON_CLIENT_ID`.
"""

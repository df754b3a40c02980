"""Home clusters: the machines of a LAN as one synchronous torch.distributed cluster.

Members find each other by mDNS, prove a shared secret to each other, elect the most senior
as leader, meet at the store it hosts for each generation, and train with DDP and a
compression hook; they re-form when a member dies or joins (docs/clusters.md).

* :mod:`.membership` -- seniority, election, when to form and re-form (pure)
* :mod:`.proof` -- the secret proven in both directions, never sent (pure)
* :mod:`.wire` -- the control endpoint's frames and bodies
* :mod:`.rendezvous` -- the control endpoint, and the leader's store per generation
* :mod:`.roster` -- the members one member knows of, and who refused it
* :mod:`.joining` -- a follower asking to join, and the leader's desk of requests
* :mod:`.training` -- DDP, the hooks, the state broadcast, the collective timeout
* :mod:`.runtime` -- the asyncio shell that ties them together (:mod:`.threads`: its
  daemon threads)
* :mod:`.settings`, :mod:`.events`, :mod:`.interfaces` -- what a member is told, what it
  tells, and which of the machine's addresses it uses
"""

"""What runs a node's roles, the same in a node and in the simulator: one runner per role
(:mod:`.runner`), the peer services they share (:mod:`.services`: whom to ask, hedged
questions, blame), how each kind of fetch is answered (:mod:`.fetches`, :mod:`.catch_up`),
and the role failures (:mod:`.failures`). It reaches the network and the disk only through
the seam of :mod:`.transport`."""

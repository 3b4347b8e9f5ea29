"""Protocol identifiers: ``/locomesh/<name>/<major>.<minor>``, one per service a node serves."""

PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 0


def protocol_id(name: str, major: int = PROTOCOL_MAJOR, minor: int = PROTOCOL_MINOR) -> str:
    """The libp2p protocol id of locomesh service ``name`` (e.g. ``/locomesh/state/1.0``)."""
    if not name or "/" in name:
        raise ValueError(f"protocol name must be a non-empty word without '/', got {name!r}")
    return f"/locomesh/{name}/{major}.{minor}"


STATE = protocol_id("state")  # joiners download weights, outer-optimizer state and round
AVERAGE = protocol_id("average")  # members of an outer round fetch each other's pseudo-gradients
STATUS = protocol_id("status")  # anyone may ask a node what it is doing
STAGE = protocol_id("stage")  # pipeline trainers send activations through stage servers
ZO = protocol_id("zo")  # zeroth-order replicas fetch each other's one-byte step codes and the log of applied rounds
DIALBACK = protocol_id("dialback")  # a peer dials the requester back to tell it whether it is publicly reachable
RELAY = protocol_id("relay")  # a public peer carries a stream to a peer behind NAT that keeps a connection to it
RELAYED = protocol_id("relayed")  # the relay's leg to that peer: which client and protocol the stream is for

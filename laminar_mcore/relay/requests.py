"""What each relay endpoint accepts: its body's (or query's) fields, their types and ranges.

A request with a field that is unknown, missing, of the wrong type, not finite or out of range
is answered 400 with a message naming the field (``netutil.check_fields``), before the handler
changes anything. tests/malformed.py sends every endpoint a table of such requests.
"""

from __future__ import annotations

from ..netutil import Field

PORT = Field("int", low=1, high=65535)
HOST = Field("str", max_len=255)
RELAY_ID = Field("str", max_len=128)
LEASE_ID = Field("str", required=True, max_len=128)
INDEX = Field("int", low=0, high=2**31 - 1)

NO_QUERY: dict = {}

# GET /latest?after=V&wait_s=T (wait_s above 60 is waited 60)
LATEST = {"after": Field("int", low=-1), "wait_s": Field("number", low=0, high=86400)}

# POST /pull: the lease; ``devices``/``device`` for CUDA IPC (the transport checks them)
PULL = {"min_version": Field("int", low=-1), "ttl_s": Field("number", low=0.001, high=86400 * 7),
        "format": Field("str", max_len=64),
        "devices": Field("list", max_len=64, item=Field("str", max_len=64)),
        "device": Field("str", max_len=64),
        # each engine rank's own shard (relay/shard_pulls.py): the engine's TP size, heads,
        # tied output layer, expert parallel size
        "shard": Field("dict", fields={"tp_size": Field("int", required=True, low=1, high=1024),
                                       "heads": Field("int", required=True, low=1,
                                                      high=1_000_000),
                                       "tied": Field("bool"),
                                       "ep_size": Field("int", low=1, high=1024)})}

# POST /bucket (without ``index``: only the ``applied`` acknowledgements)
BUCKET = {"lease_id": LEASE_ID, "index": Field("int", low=0, high=2**31 - 1),
          "applied": Field("list", max_len=65536, item=INDEX)}

# POST /release
RELEASE = {"lease_id": LEASE_ID}

# POST /release_holder: every lease taken from this address (its host went away)
RELEASE_HOLDER = {"host": Field("str", required=True, max_len=255)}

# POST /set_downstream (the master: the next relay of the chain; none: this is the last)
SET_DOWNSTREAM = {"relays_after_source": Field("int", low=1, high=100_000), "data_host": HOST,
                  "data_port": PORT}

# a relay's place in the chain: POST /register, and each of POST /promote's ``relays``
CHAIN_ENTRY = {"relay_id": Field("str", required=True, max_len=128),
               "control_url": Field("url", required=True, max_len=300),
               "data_host": Field("str", required=True, max_len=255),
               "data_port": Field("int", required=True, low=1, high=65535)}
# (a striped tier: the registering relay's [stripe, stripes]; its master's must be the same)
REGISTER = {**CHAIN_ENTRY, "stripe": Field("list", max_len=2, item=Field("int", low=0,
                                                                         high=4096)),
            "trainer_stages": Field("int", low=1, high=1_000_000)}

# POST /report_failure: a relay's downstream (host:port of its data port) failed
REPORT_FAILURE = {"data_addr": Field("str", required=True, max_len=300)}

# POST /promote: the controller elected this relay master; the other live relays
PROMOTE = {"relays": Field("list", max_len=4096, item=Field("dict", fields=CHAIN_ENTRY))}

# POST /set_master
SET_MASTER = {"master_url": Field("url", required=True, max_len=300)}

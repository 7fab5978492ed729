"""Where the swarm meets by default, and how often its members must speak: the numbers the
tracker, nodes and clients agree on (as Majordomo keeps its heartbeat constants in one
place). Each side may be configured otherwise; these are the defaults both start from."""

DEFAULT_TRACKER = "tcp://127.0.0.1:5555"  # the tracker's ROUTER: requests from nodes and clients
DEFAULT_PUB = "tcp://127.0.0.1:5556"  # the tracker's PUB: plans, stats and events

HEARTBEAT_INTERVAL = 1.0  # seconds between a node's heartbeats to the tracker
HEARTBEAT_LIVENESS = 3  # heartbeats a node may miss before the tracker drops it from plans
TRACKER_SILENCE = 5.0  # seconds a running tracker takes at most to answer: a client gives up, a node warns

PING_INTERVAL = 0.25  # a head pings the hops of its active routes this often
PEER_SILENCE = 10.0  # a hop that answers nothing this long is dead (hung, unreachable)
LINK_GRACE = 0.25  # a hop whose TCP link stays down this long is dead (its process died)
# a node's connection silent this long is probed by the kernel, once a second, and closed after
# this many probes unanswered: a client whose machine vanished is gone in about PEER_SILENCE
KEEPALIVE_IDLE_S, KEEPALIVE_INTVL_S, KEEPALIVE_PROBES = 5, 1, 5

AUDIT_RATE = 0.05  # share of a head's requests whose steps replicas re-run after they end
AUDIT_TOLERANCE = 0.1  # relative distance allowed between a hop's and a replica's output at any position

TOPIC_PLANS, TOPIC_STATS, TOPIC_EVENTS = b"plans", b"stats", b"events"  # the tracker's PUB topics

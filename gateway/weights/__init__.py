"""Weight versions: the coordinator of each gateway process and what it is made of (docs/architecture.md §5).

- `labels`: the labels engines carry for a version, and back, and the prefix-cache salt of a version;
- `state`: the coordinator's states and the one table of their transitions;
- `report`: `UpdateReport`, what one update did;
- `sequence`: THE update sequence (pause → load → settle → resume) that every weight change runs;
- `coordinator`: `WeightCoordinator`, the facade: updates, the out-of-band sync, catch-ups, adopting results;
- `bracket`: the out-of-band sync held between `POST /admin/pause` and `POST /admin/resume`, with its deadline;
- `transfer`: the two-phase in-memory update (`POST /admin/weights` with `transfer`, then its commit); `relay`: a
  commit that reached another process, relayed on the bus to the one holding the transfer;
- `leader`, `follower`, `recovery`: the processes sharing one Redis (leading an update, following another's,
  recovering from one whose coordinator died); `host`: what the follower and the recovery see of the coordinator;
- `gate`, `gc_deferral`: what generation waits on, and the GC kept out of the release burst;
- `admission`: a replica joins or rejoins the pool on the pool's weights;
- `budget`: the staleness budget: new sessions admitted by it, samples that fell behind it cut.
"""

from gateway.weights.admission import ReplicaAdmission, reported_version
from gateway.weights.bracket import OutOfBandSync
from gateway.weights.budget import BudgetCounts, StalenessBudget
from gateway.weights.coordinator import MEMBER_TTL_S, WeightCoordinator
from gateway.weights.labels import INITIAL_LABELS, cache_salt, newer, parse_version, version_label, version_labels
from gateway.weights.report import UpdateReport, UpdateStatus
from gateway.weights.state import TRANSITIONS, IllegalTransition, State, StateMachine

__all__ = [
    "INITIAL_LABELS",
    "MEMBER_TTL_S",
    "TRANSITIONS",
    "IllegalTransition",
    "OutOfBandSync",
    "BudgetCounts",
    "ReplicaAdmission",
    "StalenessBudget",
    "State",
    "StateMachine",
    "UpdateReport",
    "UpdateStatus",
    "WeightCoordinator",
    "cache_salt",
    "newer",
    "parse_version",
    "reported_version",
    "version_label",
    "version_labels",
]

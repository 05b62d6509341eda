"""C-MLFQ: tool-return states, causal prefix tree, routing policies, and the dispatcher plug point."""

from areal_libra.cmlfq.dispatcher import Dispatcher, NoHealthyServer, ServerGroup, request_from_meta
from areal_libra.cmlfq.migration import MigrationPrice, MigrationPricer
from areal_libra.cmlfq.policy import (
    POLICIES,
    Bucket,
    CMLFQConfig,
    CMLFQPolicy,
    LeastLoadedPolicy,
    MLFQPolicy,
    OraclePolicy,
    PredictorPolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    make_policy,
)
from areal_libra.cmlfq.states import RequestInfo, SizeClasses, ToolState, tool_state
from areal_libra.cmlfq.tree import NodeStats, PrefixTree, TreeFileError, cpp_available, decision_contexts

__all__ = [
    "POLICIES", "Bucket", "CMLFQConfig", "CMLFQPolicy", "Dispatcher", "LeastLoadedPolicy", "MLFQPolicy",
    "MigrationPrice", "MigrationPricer",
    "NoHealthyServer", "NodeStats", "OraclePolicy", "PredictorPolicy", "PrefixTree", "RequestInfo",
    "RoundRobinPolicy", "RoutingPolicy", "ServerGroup", "SizeClasses", "ToolState", "TreeFileError",
    "cpp_available", "decision_contexts", "make_policy", "request_from_meta", "tool_state",
]

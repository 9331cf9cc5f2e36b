#pragma once
/// @file groups.hpp
/// @brief Replica groups: jobs whose replicas are groups of ranks. `group_communicator`
/// (groups/group_communicator.hpp): collectives inside a group, and across the groups one
/// communicator per rank index; `GroupManager` (groups/group_manager.hpp): the fault-tolerance
/// protocol with a group as one replica. See docs/replica-groups.md.

#include <ddp/groups/group_communicator.hpp>
#include <ddp/groups/group_manager.hpp>

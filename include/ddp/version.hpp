#pragma once
/// @file version.hpp
/// @brief Library version, checked against the CMake project version by a test.

/// Major version: incompatible API changes.
#define DDP_VERSION_MAJOR 0
/// Minor version: additions.
#define DDP_VERSION_MINOR 1
/// Patch version: fixes.
#define DDP_VERSION_PATCH 0
/// Single comparable number: major * 10000 + minor * 100 + patch.
#define DDP_VERSION (DDP_VERSION_MAJOR * 10000 + DDP_VERSION_MINOR * 100 + DDP_VERSION_PATCH)

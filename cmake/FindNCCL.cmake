#[=======================================================================[.rst:
FindNCCL
--------

Finds the NVIDIA Collective Communications Library.

NCCL installs a CMake package config only from 2.29.7 on; Debian packages, pip wheels, the
CUDA-bundled copies and every older install ship none. So this module asks for the config
first (quietly) and falls back to locating ``nccl.h`` and ``libnccl`` itself.

Hints
^^^^^

``NCCL_ROOT`` (CMake or environment variable)
  Installation prefix to search first.
``CUDAToolkit_INCLUDE_DIRS`` / ``CUDAToolkit_LIBRARY_DIR``
  Used when ``find_package(CUDAToolkit)`` ran before, since NCCL often lives beside CUDA.

Result variables
^^^^^^^^^^^^^^^^

``NCCL_FOUND``, ``NCCL_VERSION`` (``major.minor.patch`` parsed from ``nccl.h``),
``NCCL_INCLUDE_DIR``, ``NCCL_LIBRARY``.

Imported target
^^^^^^^^^^^^^^^

``NCCL::nccl``
#]=======================================================================]

include(FindPackageHandleStandardArgs)

# 1. NCCL's own package config (2.29.7+). It defines NCCL::nccl itself.
find_package(NCCL CONFIG QUIET)
if(NCCL_FOUND AND TARGET NCCL::nccl)
  find_package_handle_standard_args(NCCL CONFIG_MODE)
  return()
endif()

# 2. Fallback: header and library by hand.
set(_nccl_hints)
foreach(_root IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}")
  if(_root)
    list(APPEND _nccl_hints "${_root}")
  endif()
endforeach()
file(GLOB _nccl_cuda_prefixes LIST_DIRECTORIES true /usr/local/cuda /usr/local/cuda-*)

find_path(NCCL_INCLUDE_DIR
  NAMES nccl.h
  HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
  PATHS ${_nccl_cuda_prefixes}
  PATH_SUFFIXES include)

find_library(NCCL_LIBRARY
  NAMES nccl libnccl.so.2
  HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
  PATHS ${_nccl_cuda_prefixes}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
       REGEX "^#define[ \t]+NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  foreach(_part IN ITEMS MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part}[ \t]+([0-9]+)" _match "${_nccl_version_lines}")
    set(NCCL_VERSION_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT "${NCCL_VERSION_MAJOR}" STREQUAL "")
    set(NCCL_VERSION "${NCCL_VERSION_MAJOR}.${NCCL_VERSION_MINOR}.${NCCL_VERSION_PATCH}")
  endif()
endif()

find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()

mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
unset(_nccl_hints)
unset(_nccl_cuda_prefixes)
unset(_nccl_version_lines)

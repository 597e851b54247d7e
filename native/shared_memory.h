// Huge pages for the CPU tier's shared memory where the kernel would not give them on request.
#pragma once

#include <cstddef>

namespace infinity {

// Turn the first `nbytes` of shared-memory file `fd` (a memfd) into 2 MiB pages with
// MADV_COLLAPSE (Linux 6.1+), which, unlike MADV_HUGEPAGE, does not depend on
// /sys/kernel/mm/transparent_hugepage/shmem_enabled being on (only "deny" refuses it).
// Physically contiguous pages matter to a disk: DMA into scattered 4 KiB pages splits each
// request into many segments. Pages present keep their bytes; holes are filled with zeros, but
// each 2 MiB range needs one page present (the kernel refuses a range that is all hole). Only
// whole 2 MiB ranges within both nbytes and the file's size are collapsed.
// Works through a temporary mapping at a 2 MiB-aligned address (a file's huge pages must
// line up with the mapping's); the caller's mappings of fd see the new pages.
// Returns 0, or the errno of madvise: EINVAL (kernel without it, or denied), ENOMEM or
// EAGAIN (not enough contiguous memory free: some pages stay 4 KiB). Throws SysError when
// the temporary mapping cannot be made.
int collapse_shared_memory(int fd, size_t nbytes);

}  // namespace infinity

// CRC32C (Castagnoli), the checksum the store keeps for every 1 MiB block.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinity {

// Standard CRC32C with the usual pre/post inversion, so that
// crc32c("123456789", 9, 0) == 0xE3069283 and
// crc32c(b, nb, crc32c(a, na, 0)) == crc32c(a || b, na + nb, 0).
uint32_t crc32c(const void* data, size_t nbytes, uint32_t seed = 0);

// The table-driven version, always available; exposed so tests can compare.
uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t seed = 0);

// "sse4.2" when the crc32 instruction is used, else "table".
const char* crc32c_implementation();

}  // namespace infinity

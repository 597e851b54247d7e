// Error types shared by the native core. The binding turns SysError into
// OSError and AlignmentViolation into _native.AlignmentError (a ValueError),
// so Python sees an errno where there is one.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace infinity {

class SysError : public std::runtime_error {
 public:
  SysError(int err, const std::string& message) : std::runtime_error(message), err_(err) {}
  int err() const noexcept { return err_; }

 private:
  int err_;
};

class AlignmentViolation : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// "EBADF" (or "errno 1234" for numbers the C library does not know).
std::string errno_name(int err);
// "Bad file descriptor (EBADF)".
std::string errno_text(int err);
// "0x7f12340001" - addresses read better in hex in messages.
std::string hex(uint64_t value);

}  // namespace infinity

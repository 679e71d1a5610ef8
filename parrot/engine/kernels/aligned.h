// Buffers on 64-byte boundaries. An AMX tile row or a 512-bit vector that straddles two cache lines is
// read (or written) as two: a tile load from malloc's 16-byte-aligned memory runs about 4x slower than
// from aligned memory, which held the tile loops at a quarter of the tile unit's speed.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace aligned {

template <class T>
struct Allocator {
  using value_type = T;
  Allocator() = default;
  template <class U>
  Allocator(const Allocator<U>&) {}  // NOLINT: rebinding
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Allocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const Allocator<U>&) const { return false; }
};

template <class T>
using vector = std::vector<T, Allocator<T>>;

// A 512-bit vector as an element type (std::vector<__m512i> drops the type's alignment attribute).
struct alignas(64) Bits512 {
  unsigned char b[64];
};

}  // namespace aligned

use super::CumemMode;
use cumem::DeviceAllocatorMode;

/// `cumem_set_device_allocator_mode` reads a C value as a position in
/// `DeviceAllocatorMode::ALL`: the header's values must be those.
#[test]
fn the_c_mode_values_are_the_modes_positions() {
    for (i, &mode) in DeviceAllocatorMode::ALL.iter().enumerate() {
        assert_eq!(CumemMode::of(mode) as usize, i, "{mode}");
    }
}

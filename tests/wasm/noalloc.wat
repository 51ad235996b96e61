;; A filter without seedance_alloc: the host cannot hand it input (bad_abi).
(module
  (import "seedance" "output" (func $output (param i32 i32)))
  (memory (export "memory") 1)
  (func (export "seedance_filter") (param i32 i32) (result i32)
    (call $output (local.get 0) (local.get 1))
    (i32.const 0)))

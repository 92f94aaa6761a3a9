"""Measuring: the stopwatch and `MeasureSession` (`harness`), the correctness gate (`cases`), results and byte
model (`results`), the spread of timings (`spread`), host-side timing (`host_rounds`, `views`), the peer libraries
(`peers`, `peers_residual`) and the head-to-head benches against them (`bench`, `bench_residual`, `bench_output`)."""

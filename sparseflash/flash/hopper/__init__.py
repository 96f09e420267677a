"""The Hopper (sm_90) Gluon kernels: `forward` (the warp-specialised forward), `backward` (the
one-pass backward), `common` (what they share: the guarded gluon import, TMA descriptors, list
walks). `sparseflash.flash.dispatch.hopper_plan` decides per call whether they run; gluon is
imported only when they do, so importing this package on a CPU machine costs nothing."""

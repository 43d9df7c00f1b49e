"""What trains a router: the balancing and auxiliary losses (moe_kernels.losses) and the REINFORCE
estimators (moe_kernels.estimators)."""

// The pod sandbox's pause process, lowtail's own (no image is downloaded): test equipment.
module lowtail.test/equipment/pause

go 1.24.0

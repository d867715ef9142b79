"""The one benchmark protocol every servopt feature measures with (see ``protocol``)."""

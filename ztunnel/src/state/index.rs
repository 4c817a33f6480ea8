//! Changes to a [`StateSnapshot`] that keep every index consistent.
//!
//! Only the writer calls these, on its private copy of the snapshot before
//! publishing it. Every index is a [`ShardedMap`](super::ShardedMap): the
//! first change to a shard copies that shard (the published snapshot still
//! shares it) and later changes to it within the same batch copy nothing.
//! Removing something absent copies nothing at all.

use std::net::IpAddr;
use std::sync::Arc;

use super::{
    Address, Authorization, Endpoint, NetworkAddress, ResourceKey, ResourceType, Service,
    ShardedMap, StateSnapshot, Workload, XdsEntry,
};

fn same_service(a: &Service, b: &Service) -> bool {
    a.namespace == b.namespace && a.hostname == b.hostname
}

impl StateSnapshot {
    /// Adds or replaces the workload with `w.uid`, updating the address and
    /// endpoint indexes (an address or service it no longer has is dropped).
    pub fn insert_workload(&mut self, w: Workload) -> Arc<Workload> {
        let w = Arc::new(w);
        let old = self.workloads.insert(w.uid.clone(), w.clone());
        if let Some(old) = &old {
            let kept = |ip| old.network == w.network && w.ips.contains(ip);
            for ip in old.ips.iter().filter(|ip| !kept(ip)) {
                self.drop_workload_addr(old, *ip);
            }
        }
        for ip in &w.ips {
            self.workloads_by_addr
                .insert(NetworkAddress::new(w.network.clone(), *ip), w.clone());
        }
        self.update_endpoints(&w.uid, old.as_deref(), Some(&w));
        w
    }

    /// Removes the workload `uid` from every index.
    pub fn remove_workload(&mut self, uid: &str) -> Option<Arc<Workload>> {
        let old = self.workloads.remove(uid)?;
        for ip in &old.ips {
            self.drop_workload_addr(&old, *ip);
        }
        self.update_endpoints(&old.uid, Some(&old), None);
        Some(old)
    }

    /// Drops `ip` of workload `old` from the address index, unless another
    /// workload has taken the address over since.
    fn drop_workload_addr(&mut self, old: &Workload, ip: IpAddr) {
        let key = NetworkAddress::new(old.network.clone(), ip);
        if self
            .workloads_by_addr
            .get(&key)
            .is_some_and(|cur| cur.uid == old.uid)
        {
            self.workloads_by_addr.remove(&key);
        }
    }

    /// Moves workload `uid` between endpoint sets as its service list
    /// changes from `old` to `new`.
    fn update_endpoints(&mut self, uid: &Arc<str>, old: Option<&Workload>, new: Option<&Workload>) {
        if let (Some(o), Some(n)) = (old, new)
            && o.services == n.services
        {
            return;
        }
        let endpoints = &mut self.endpoints;
        if let Some(old) = old {
            for key in old.services.keys() {
                if new.is_some_and(|n| n.services.contains_key(key)) {
                    continue;
                }
                let now_empty = match endpoints.get_mut(key.as_str()) {
                    Some(set) => {
                        Arc::make_mut(set).remove(uid);
                        set.is_empty()
                    }
                    None => false,
                };
                if now_empty {
                    endpoints.remove(key.as_str());
                }
            }
        }
        if let Some(new) = new {
            for (key, ports) in &new.services {
                if old.is_some_and(|o| o.services.get(key) == Some(ports)) {
                    continue;
                }
                let service: Arc<str> = Arc::from(key.as_str());
                let set = endpoints.get_or_insert_with(service.clone(), Default::default);
                Arc::make_mut(set).insert(
                    uid.clone(),
                    Endpoint {
                        workload_uid: uid.clone(),
                        service,
                        ports: ports.clone(),
                    },
                );
            }
        }
    }

    /// Adds or replaces the service `namespace/hostname`, updating the VIP
    /// index (a VIP it no longer has is dropped).
    pub fn insert_service(&mut self, s: Service) -> Arc<Service> {
        let key: Arc<str> = Arc::from(s.key());
        let s = Arc::new(s);
        let old = self.services.insert(key, s.clone());
        if let Some(old) = &old {
            for vip in old.vips.iter().filter(|vip| !s.vips.contains(vip)) {
                self.drop_service_vip(old, vip);
            }
        }
        for vip in &s.vips {
            self.services_by_vip.insert(vip.clone(), s.clone());
        }
        s
    }

    /// Removes the service `namespace/hostname` and its VIPs. Its endpoints
    /// are no longer visible through [`StateSnapshot::endpoints`].
    pub fn remove_service(&mut self, key: &str) -> Option<Arc<Service>> {
        let old = self.services.remove(key)?;
        for vip in &old.vips {
            self.drop_service_vip(&old, vip);
        }
        Some(old)
    }

    /// Drops `vip` of service `old` from the VIP index, unless another
    /// service has taken the VIP over since.
    fn drop_service_vip(&mut self, old: &Service, vip: &NetworkAddress) {
        if self
            .services_by_vip
            .get(vip)
            .is_some_and(|cur| same_service(cur, old))
        {
            self.services_by_vip.remove(vip);
        }
    }

    /// Adds or replaces the policy `namespace/name`.
    pub fn insert_authorization(&mut self, a: Authorization) -> Arc<Authorization> {
        let a = Arc::new(a);
        self.policies.insert(Arc::from(a.key()), a.clone());
        a
    }

    /// Removes the policy `namespace/name`.
    pub fn remove_authorization(&mut self, key: &str) -> Option<Arc<Authorization>> {
        self.policies.remove(key)
    }

    fn remove_key(&mut self, key: &ResourceKey) {
        match key {
            ResourceKey::Workload(uid) => {
                self.remove_workload(uid);
            }
            ResourceKey::Service(k) => {
                self.remove_service(k);
            }
            ResourceKey::Authorization(k) => {
                self.remove_authorization(k);
            }
        }
    }

    fn resources_mut(&mut self, ty: ResourceType) -> &mut ShardedMap<Arc<str>, XdsEntry> {
        match ty {
            ResourceType::Address => &mut self.address_resources,
            ResourceType::Authorization => &mut self.authorization_resources,
        }
    }

    /// Applies the xDS resource `name` at `version`: if the name stood for
    /// something else before, that is removed first.
    pub fn apply_address(&mut self, name: &str, version: &str, address: Address) {
        let key = match &address {
            Address::Workload(w) => ResourceKey::Workload(w.uid.clone()),
            Address::Service(s) => ResourceKey::Service(Arc::from(s.key())),
        };
        self.replace_entry(ResourceType::Address, name, version, key);
        match address {
            Address::Workload(w) => {
                self.insert_workload(*w);
            }
            Address::Service(s) => {
                self.insert_service(*s);
            }
        }
    }

    /// Applies the xDS authorization resource `name` at `version`.
    pub fn apply_authorization(&mut self, name: &str, version: &str, auth: Authorization) {
        let key = ResourceKey::Authorization(Arc::from(auth.key()));
        self.replace_entry(ResourceType::Authorization, name, version, key);
        self.insert_authorization(auth);
    }

    fn replace_entry(&mut self, ty: ResourceType, name: &str, version: &str, key: ResourceKey) {
        let previous = self.resources_mut(ty).insert(
            Arc::from(name),
            XdsEntry {
                version: Arc::from(version),
                key: key.clone(),
            },
        );
        if let Some(previous) = previous
            && previous.key != key
        {
            self.remove_key(&previous.key);
        }
    }

    /// Removes the xDS resource `name` of type `ty` and what it stood for.
    /// Returns false if it was not held.
    pub fn remove_resource(&mut self, ty: ResourceType, name: &str) -> bool {
        match self.resources_mut(ty).remove(name) {
            Some(entry) => {
                self.remove_key(&entry.key);
                true
            }
            None => false,
        }
    }
}

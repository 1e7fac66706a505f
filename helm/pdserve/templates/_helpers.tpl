{{/* Names ------------------------------------------------------------------------------------ */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Resource prefix; suffixes (-router, -prefill, -decode, -engine...) must still fit 63 chars. */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Headless Service of a pool; the router selects its EndpointSlices by this name. */}}
{{- define "pdserve.poolService" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .role }}
{{- end }}

{{- define "pdserve.routerServiceAccount" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (printf "%s-router" (include "pdserve.fullname" .)) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Labels: call with (dict "root" $ "component" "router|prefill|decode") ------------------ */}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/* Labels shared by every pod of the release (NetworkPolicy peers). */}}
{{- define "pdserve.releaseLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Image ------------------------------------------------------------------------------------ */}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) .Values.image.tagSuffix }}
{{- end }}

{{/* GPUs per replica of a pool: (dict "root" $ "role" "prefill|decode"). One pod holds them all:
the decode pool's experts are spread (EP) over the same tp GPUs as its attention (TP). */}}
{{- define "pdserve.gpus" -}}
{{- $pool := index .root.Values .role }}
{{- if ne .root.Values.device "cuda" }}0{{ else }}{{ $pool.tp }}{{ end }}
{{- end }}

{{/* Configuration checks that a schema cannot express. */}}
{{- define "pdserve.validate" -}}
{{- $d := .Values.decode }}
{{- if ne (mod (int $d.tp) (int $d.ep)) 0 }}
{{- fail (printf "decode.ep (%v) must divide decode.tp (%v): experts are spread over the replica's tp GPUs (e.g. ep 4 with tp 4)" $d.ep $d.tp) }}
{{- end }}
{{- if eq .Values.router.discovery "static" }}
{{- if or (empty .Values.router.staticWorkers.prefill) (empty .Values.router.staticWorkers.decode) }}
{{- fail "router.discovery=static needs router.staticWorkers.prefill and .decode (host:port lists); use discovery=kubernetes to find this release's pools" }}
{{- end }}
{{- end }}
{{- if and (eq .Values.model.volume.type "pvc") (empty .Values.model.volume.claimName) }}
{{- fail "model.volume.claimName is required with model.volume.type=pvc (a PVC holding config.json and *.safetensors)" }}
{{- end }}
{{- if and (eq .Values.model.volume.type "hostPath") (empty .Values.model.volume.hostPath) }}
{{- fail "model.volume.hostPath is required with model.volume.type=hostPath" }}
{{- end }}
{{- if and .Values.workers.rdma.enabled (eq .Values.device "cuda") (empty .Values.workers.rdma.resources) (empty .Values.workers.rdma.resourcesPerGpu) }}
{{- fail "workers.rdma.enabled needs workers.rdma.resources or workers.rdma.resourcesPerGpu (your RDMA device plugin's resource, e.g. {\"rdma/rdma_shared_device_a\": 1}); without an RDMA device in the pod UCX has no HCA and KV cannot move over RDMA. Set workers.rdma.enabled=false to move KV over TCP" }}
{{- end }}
{{- $r := .Values.router }}
{{- if and $r.auth.enabled (empty $r.auth.existingSecret) }}
{{- fail "router.auth.enabled needs router.auth.existingSecret: a Secret whose key router.auth.secretKey holds the API keys, one per line (kubectl create secret generic pdserve-api-keys --from-file=api-keys=./keys.txt)" }}
{{- end }}
{{- if and $r.tls.enabled (empty $r.tls.secretName) }}
{{- fail "router.tls.enabled needs router.tls.secretName: a kubernetes.io/tls Secret (tls.crt, tls.key), e.g. from cert-manager" }}
{{- end }}
{{- if and (ne $r.service.type "ClusterIP") (not $r.auth.enabled) (not $r.service.allowUnauthenticated) }}
{{- fail (printf "router.service.type=%s exposes the router beyond the cluster: turn on router.auth (API keys; router.tls too), or set router.service.allowUnauthenticated=true to expose it without keys" $r.service.type) }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- $grace := int (index $.Values $role).terminationGracePeriodSeconds }}
{{- if lt $grace (add (int $.Values.workers.preStopSleepSeconds) 6) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must exceed workers.preStopSleepSeconds + 5 s: it holds the preStop pause, the drain and the exit" $role $grace) }}
{{- end }}
{{- end }}
{{- $jit := .Values.workers.jitCache }}
{{- if and (eq $jit.type "pvc") (empty $jit.claimName) }}
{{- fail "workers.jitCache.type=pvc needs workers.jitCache.claimName (a ReadWriteMany claim)" }}
{{- end }}
{{- if and (eq $jit.type "hostPath") (not (and .Values.workers.rdma.enabled (eq .Values.device "cuda"))) }}
{{- fail "workers.jitCache.type=hostPath needs root workers (RDMA on CUDA): a directory the kubelet creates is root's, and non-root workers could not write it; use emptyDir or pvc" }}
{{- end }}
{{- if and .Values.decode.autoscaling.enabled .Values.decode.keda.enabled }}
{{- fail "decode.autoscaling (an HPA) and decode.keda (a ScaledObject, which makes its own HPA) would fight over the decode pool: enable one" }}
{{- end }}
{{- if and .Values.decode.autoscaling.enabled (empty .Values.decode.autoscaling.metrics) }}
{{- fail "decode.autoscaling.enabled needs decode.autoscaling.metrics (custom/external metrics: CPU says nothing about decode load)" }}
{{- end }}
{{- end }}

{{/* Pod pieces shared by the router and the pools ----------------------------------------------- */}}

{{- define "pdserve.modelVolume" -}}
- name: model
{{- if eq .Values.model.volume.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.volume.claimName }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ .Values.model.volume.hostPath }}
    type: Directory
{{- end }}
{{- end }}

{{- define "pdserve.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.path }}
  readOnly: true
{{- with .Values.model.volume.subPath }}
  subPath: {{ . }}
{{- end }}
{{- end }}

{{- define "pdserve.podEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}

{{- define "pdserve.envMap" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/* Scheduling of a pool's pods: user affinity plus pod (anti-)affinity from spreadReplicas:
"pack" puts every replica of the pool on one node (required podAffinity to each other; the first
replica may go anywhere), "preferred"/"required" spread them over nodes. */}}
{{- define "pdserve.poolAffinity" -}}
{{- $pool := index .root.Values .role }}
{{- $affinity := deepCopy ($pool.affinity | default dict) }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "pdserve.selectorLabels" (dict "root" .root "component" .role) | fromYaml)) }}
{{- if and (eq $pool.spreadReplicas "pack") (not (hasKey $affinity "podAffinity")) }}
{{- $_ := set $affinity "podAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
{{- else if and (has $pool.spreadReplicas (list "preferred" "required")) (not (hasKey $affinity "podAntiAffinity")) }}
{{- if eq $pool.spreadReplicas "required" }}
{{- $_ := set $affinity "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
{{- else }}
{{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) }}
{{- end }}
{{- end }}
{{- if $affinity }}
{{- toYaml $affinity }}
{{- end }}
{{- end }}

{{/* Container resources of a pool: the user's cpu/memory plus GPUs and RDMA devices (a fixed
count per pod, e.g. one shared HCA, and/or a count per GPU, e.g. one SR-IOV VF per GPU's NIC).
Extended resources cannot be overcommitted, so requests equal limits for them. */}}
{{- define "pdserve.poolResources" -}}
{{- $pool := index .root.Values .role }}
{{- $resources := deepCopy ($pool.resources | default dict) }}
{{- $limits := $resources.limits | default dict }}
{{- $requests := $resources.requests | default dict }}
{{- $gpus := include "pdserve.gpus" . | int }}
{{- if gt $gpus 0 }}
{{- $_ := set $limits .root.Values.workers.gpuResourceName $gpus }}
{{- $_ := set $requests .root.Values.workers.gpuResourceName $gpus }}
{{- end }}
{{- if and .root.Values.workers.rdma.enabled (gt $gpus 0) }}
{{- range $name, $count := .root.Values.workers.rdma.resources }}
{{- $_ := set $limits $name $count }}
{{- $_ := set $requests $name $count }}
{{- end }}
{{- range $name, $count := .root.Values.workers.rdma.resourcesPerGpu }}
{{- $_ := set $limits $name (mul $count $gpus) }}
{{- $_ := set $requests $name (mul $count $gpus) }}
{{- end }}
{{- end }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set $resources "requests" $requests }}
{{- toYaml $resources }}
{{- end }}

{{/* PriorityClass of a component: its own priorityClassName, else the one the chart creates. */}}
{{- define "pdserve.priorityClassName" -}}
{{- $own := (index .root.Values .component).priorityClassName }}
{{- if $own }}{{ $own }}
{{- else if .root.Values.scheduling.priorityClass.create }}{{ include "pdserve.priorityClassCreated" .root }}
{{- end }}
{{- end }}

{{/* PriorityClasses are cluster-scoped: the name carries the namespace too. */}}
{{- define "pdserve.priorityClassCreated" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.podGroup" -}}
{{- printf "%s-workers" (include "pdserve.fullname" .) }}
{{- end }}

{{/* Pods a gang needs at once: every prefill and decode replica (the HPA's floor when autoscaled). */}}
{{- define "pdserve.gangSize" -}}
{{- $decode := .Values.decode.replicas }}
{{- if .Values.decode.autoscaling.enabled }}{{ $decode = .Values.decode.autoscaling.minReplicas }}{{ end }}
{{- if .Values.decode.keda.enabled }}{{ $decode = .Values.decode.keda.minReplicas }}{{ end }}
{{- add .Values.prefill.replicas $decode }}
{{- end }}

{{/* Seconds a worker drains after SIGTERM: the pod's grace period minus the preStop pause before
SIGTERM and 5 s to tear down, so the kubelet's SIGKILL never cuts a stream the drain still waits for. */}}
{{- define "pdserve.drainTimeout" -}}
{{- $pool := index .root.Values .role }}
{{- sub (int $pool.terminationGracePeriodSeconds) (add (int .root.Values.workers.preStopSleepSeconds) 5) }}
{{- end }}
